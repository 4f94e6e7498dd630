"""Node 0's view of the roles other nodes run: :class:`RemoteRole` and the nodes' heartbeats (:class:`NodeWatch`).

Each other node's serve (:mod:`afd_mrv2.serve.agent`) starts its roles, publishes every role's state in the
rendezvous store and beats once per :data:`BEAT_S`.  Node 0's supervisor holds a :class:`RemoteRole` for each
of those roles: it becomes ready, exits and is signalled or restarted as a local
:class:`~afd_mrv2.serve.roles.RoleProcess` is, through the store.  A node silent for :data:`NODE_SILENT_S`
is lost, and with it every role it runs: each exits as killed, the reason naming the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from typing import Any, TextIO

from afd_mrv2.serve.plan import RoleSpec
from afd_mrv2.serve.rendezvous import RendezvousHost
from afd_mrv2.serve.roles import RoleProcess

#: How often a node's serve beats and publishes its roles' states.
BEAT_S = 0.5
#: A node whose heartbeat stayed still this long is lost (the same bound holds for node 0, seen from the others).
NODE_SILENT_S = 5.0
#: How often node 0 reads a remote role's state.
LOOK_S = 0.2


class NodeWatch:
    """The heartbeats of the other nodes, as node 0 sees them; a node silent for :data:`NODE_SILENT_S` after
    it first beat is lost for good (its serve stops its roles itself when it cannot reach node 0)."""

    def __init__(self, rendezvous: RendezvousHost, nodes: range, say: Callable[[str], None]) -> None:
        self.rendezvous = rendezvous
        self.say = say
        #: per node: (last count seen, when it last changed); absent until the node first beat
        self._seen: dict[int, tuple[int, float]] = {}
        self._nodes = nodes
        #: lost nodes and why
        self.lost: dict[int, str] = {}
        self.info: dict[int, dict[str, Any]] = {}

    def name(self, node: int) -> str:
        """``node 1 (10.0.0.2, host node1)`` once it announced itself, else ``node 1``."""
        info = self.info.get(node)
        return f"node {node} ({info.get('addr')}, host {info.get('host')})" if info else f"node {node}"

    def state(self) -> dict[str, str]:
        """``/afd/status``'s nodes: each node's ``live``, ``lost: why`` or ``joining``."""
        out = {}
        for node in self._nodes:
            out[str(node)] = (
                f"lost: {self.lost[node]}" if node in self.lost else "live" if node in self._seen else "joining"
            )
        return out

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            for node in self._nodes:
                if node in self.lost:
                    continue
                count = await self.rendezvous.call(lambda s, n=node: s.beats(n))  # type: ignore[misc]
                if node not in self.info:
                    info = await self.rendezvous.call(lambda s, n=node: s.node_info(n))  # type: ignore[misc]
                    if info:
                        self.info[node] = info
                last = self._seen.get(node)
                if count and (last is None or count != last[0]):
                    self._seen[node] = (count, now)
                elif last is not None and now - last[1] >= NODE_SILENT_S:
                    self.lost[node] = f"silent for {now - last[1]:.1f} s"
                    self.say(f"{self.name(node)} is silent for {now - last[1]:.1f} s: every role on it is lost")
            await asyncio.sleep(BEAT_S)


class RemoteRole(RoleProcess):
    """One launch of a role rank another node runs, as node 0's supervisor drives it through the store."""

    def __init__(
        self,
        spec: RoleSpec,
        log: TextIO,
        on_exit: Callable[[RoleProcess], None],
        *,
        rendezvous: RendezvousHost,
        nodes: NodeWatch,
        launch: int = 1,
    ) -> None:
        super().__init__(spec, log, on_exit)
        self.rendezvous = rendezvous
        self.nodes = nodes
        self.launch = launch
        self.url = ""
        self._pid = -1
        self._how = ""
        self._alive = True

    @property
    def pid(self) -> int:
        return self._pid

    def describe(self) -> str:
        return f"{self.spec.title} (pid {self._pid} on {self.nodes.name(self.spec.node)})"

    def where(self) -> str:
        return f"on {self.nodes.name(self.spec.node)}"

    def describe_exit(self) -> str:
        return self._how or "running"

    async def start(self) -> None:
        """Ask its node to start this launch (the first starts with the node), then follow its state."""
        self.started_at = time.time()
        if self.launch > 1:
            spec, launch = self.spec, self.launch
            await self.rendezvous.call(lambda s: s.request_restart(spec.role, spec.rank, launch))
        self._tasks = [asyncio.ensure_future(self._follow())]

    async def _follow(self) -> None:
        spec = self.spec
        while self._alive:
            state = await self.rendezvous.call(lambda s: s.role_state(spec.role, spec.rank))
            lost = self.nodes.lost.get(spec.node)
            if lost is not None:
                self._how = f"{self.nodes.name(spec.node)} {lost}"
                self._alive = False
                self._exit(-signal.SIGKILL)
            elif state and state.get("launch") == self.launch:
                self._take(state)
            await asyncio.sleep(LOOK_S)

    def _take(self, state: dict[str, Any]) -> None:
        self._pid = int(state.get("pid", -1))
        self.started_at = float(state.get("started_at", self.started_at))
        self.url = str(state.get("url") or "")
        if state.get("ready") and not self.ready.is_set():
            self.ready.set()
        if state.get("exit") is not None:
            self._how = str(state.get("how", ""))
            self._alive = bool(state.get("alive"))
            self._exit(int(state["exit"]))

    def _exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.on_exit(self)

    def alive(self) -> bool:
        """Whether any process of its group still runs, as its node last said (False once the node is lost)."""
        return self._alive

    def signal_group(self, sig: int) -> None:
        """Ask its node to send ``sig`` to its process group (best effort: a lost node's roles are gone)."""
        self.stopping = True
        spec, launch = self.spec, self.launch
        with contextlib.suppress(RuntimeError):  # no loop: serve is gone, and with it node 0's store
            ask = self.rendezvous.call(lambda s: s.request_signal(spec.role, spec.rank, launch, sig))
            self._tasks.append(asyncio.ensure_future(ask))

    def survivors(self) -> str:
        return f"its process group on {self.nodes.name(self.spec.node)}"

    async def close(self, drain_s: float = 0.5) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
