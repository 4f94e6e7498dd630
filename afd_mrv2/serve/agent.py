"""The serve of a node other than node 0: start this node's roles, and report them to node 0 through the store.

Node 0's supervisor (:mod:`afd_mrv2.serve.supervisor`, with :mod:`afd_mrv2.serve.remote`) decides everything
(failover, restarts, stop); a :class:`NodeAgent` carries it out here.  Every :data:`~.remote.BEAT_S` it
beats, publishes each of its roles' state (launch, pid, ready, exit, whether its group lives; each role
publishes its own live figures), and carries out the signals and restarts node 0 asked for.  It stops its roles and exits when node
0 sets the stop key (0), on SIGTERM/SIGINT (0), or when node 0 stays silent for
:data:`~.remote.NODE_SILENT_S` (1, one line naming node 0): nothing of a deployment outlives its node 0.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any, TextIO

from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.serve.plan import Plan, RoleSpec
from afd_mrv2.serve.reaper import Reaper
from afd_mrv2.serve.remote import BEAT_S, NODE_SILENT_S
from afd_mrv2.serve.rendezvous import RendezvousHost
from afd_mrv2.serve.roles import POLL_S, RoleProcess

EXIT_STOPPED, EXIT_FAILED = 0, 1
#: The longest a heartbeat (or the stop key's look) waits for node 0's store.
BEAT_CALL_S = 1.0


class NodeAgent:
    def __init__(self, plan: Plan, *, log: TextIO, reap_grace_s: float = 5.0) -> None:
        self.plan = plan
        self.log = log
        self.node = plan.node
        opts = plan.options
        self.rendezvous = RendezvousHost(
            plan.afd, opts.nodes.store_host(), master=False, connect_timeout_s=opts.ready_timeout_s, secret=plan.secret
        )
        #: the latest process of each local role rank, and its launch
        self.roles: dict[tuple[str, int], RoleProcess] = {}
        self.launch: dict[tuple[str, int], int] = {}
        self._signals_done: dict[tuple[str, int], int] = {}
        self._stop = asyncio.Event()
        self.failure: str | None = None
        self.reaper = Reaper(reap_grace_s)

    def _say(self, text: str) -> None:
        print(f"[serve node {self.node}] {text}", file=self.log, flush=True)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.reaper.start()
        Path(self.plan.run_dir).mkdir(parents=True, exist_ok=True)
        try:
            if await self._join():
                beats = asyncio.ensure_future(self._beat())
                await self._start_roles()
                await self._stop.wait()
                beats.cancel()
        finally:
            await self._stop_roles()
            self.reaper.close()
            shutil.rmtree(self.plan.run_dir, ignore_errors=True)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if self.failure is not None:
            print(f"afd-mrv2 serve: error: {self.failure}; stopped node {self.node}'s roles", file=self.log, flush=True)
            return EXIT_FAILED
        self._say("stopped this node's roles")
        return EXIT_STOPPED

    def _on_signal(self, sig: int) -> None:
        self._say(f"{signal.Signals(sig).name}: stopping this node's roles")
        self._stop.set()

    async def _join(self) -> bool:
        """Reach node 0's store (it may start later: wait up to the ready timeout) and announce this node."""
        where = self.rendezvous.where
        self._say(f"joining node 0's rendezvous store on {where} as node {self.node} ({self.plan.addr})")
        joined = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, self.rendezvous.start))
        stop = asyncio.ensure_future(self._stop.wait())
        waits: set[asyncio.Future[Any]] = {joined, stop}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not joined.done():
            return False  # stopped while waiting (the connect thread ends at its own timeout)
        try:
            joined.result()
        except Exception as exc:  # noqa: BLE001 - AfdError, one line
            self.failure = str(exc)
            return False
        info = {"addr": self.plan.addr, "host": socket.gethostname(), "pid": os.getpid()}
        await self.rendezvous.call(lambda s: s.announce_node(self.node, info))
        local = ", ".join(r.name for r in self.plan.local)
        self._say(f"joined: this node runs {local}")
        return True

    async def _start_roles(self) -> None:
        """This node's FFN ranks, then (once they are ready) its Attention engines: node 0's order."""
        ffn = [self._start(spec, 1) for spec in self.plan.local if spec.role == FFN]
        started = [r for r in await asyncio.gather(*ffn) if r is not None]
        ready = asyncio.ensure_future(asyncio.gather(*(r.ready.wait() for r in started)))
        stop = asyncio.ensure_future(self._stop.wait())
        both: set[asyncio.Future[Any]] = {ready, stop}
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        for task in (ready, stop):
            task.cancel()
        if not self._stop.is_set():
            await asyncio.gather(*(self._start(spec, 1) for spec in self.plan.local if spec.role == ATTENTION))

    async def _start(self, spec: RoleSpec, launch: int) -> RoleProcess | None:
        role = RoleProcess(spec, self.log, self._on_exit)
        try:
            await role.start()
        except OSError as exc:
            self._say(f"cannot start {spec.name}: {exc}")
            return None
        self.reaper.watch(role.pid)
        key = (spec.role, spec.rank)
        self.roles[key], self.launch[key] = role, launch
        return role

    def _on_exit(self, role: RoleProcess) -> None:
        self._say(f"{role.describe()} exited ({role.describe_exit()})")

    async def _beat(self) -> None:
        """Beat every BEAT_S, on its own (a slow publish never delays it); stop when node 0 is gone, stays
        silent for NODE_SILENT_S (each beat waits at most BEAT_CALL_S: a cut is seen within about 6 s), or says
        stop."""
        last_heard = time.monotonic()
        report = asyncio.ensure_future(self._report())
        try:
            while not self._stop.is_set():
                self.rendezvous.take_error()  # what this beat meets, not what an earlier publish met
                beat = await self.rendezvous.call(lambda s: s.beat(self.node), BEAT_CALL_S)
                gone = self.rendezvous.take_error()
                if beat is not None:
                    last_heard = time.monotonic()
                elif gone is not None:
                    self.failure = f"node 0's rendezvous store ({self.rendezvous.where}) is gone: {gone}"
                    break
                silent = time.monotonic() - last_heard
                if silent >= NODE_SILENT_S:
                    self.failure = f"node 0 ({self.rendezvous.where}) is silent for {silent:.1f} s"
                    break
                if beat is not None and await self.rendezvous.call(lambda s: s.stop_requested(), BEAT_CALL_S):
                    self._say("node 0 stops the deployment")
                    break
                await asyncio.sleep(BEAT_S)
        finally:
            report.cancel()
            self._stop.set()

    async def _report(self) -> None:
        """Publish each role's state, carry out node 0's asks, every BEAT_S."""
        while True:
            for key in list(self.roles):
                await self._publish(key)
                await self._carry_out(key)
            await asyncio.sleep(BEAT_S)

    async def _publish(self, key: tuple[str, int]) -> None:
        role, spec = self.roles[key], self.roles[key].spec
        state: dict[str, Any] = {
            "launch": self.launch[key],
            "pid": role.pid,
            "started_at": role.started_at,
            "ready": role.ready.is_set(),
            "url": f"http://{spec.host}:{spec.port}" if spec.port is not None else None,
            "exit": role.returncode,
            "how": role.describe_exit() if role.returncode is not None else "",
            "alive": role.alive(),
        }
        await self.rendezvous.call(lambda s: s.publish_role(spec.role, spec.rank, state))

    async def _carry_out(self, key: tuple[str, int]) -> None:
        """The signal and the restart node 0 last asked for this role rank, each once."""
        role = self.roles[key]
        ask = await self.rendezvous.call(lambda s: s.signal_request(*key))
        if ask and ask["seq"] > self._signals_done.get(key, 0):
            self._signals_done[key] = ask["seq"]
            if ask["launch"] == self.launch[key]:
                role.signal_group(int(ask["signal"]))
        wanted = await self.rendezvous.call(lambda s: s.restart_request(*key))
        if wanted and wanted > self.launch[key] and not role.alive():
            await role.close()
            self._say(f"{role.spec.name}: restarting as launch {wanted}, as node 0 asks")
            await self._start(role.spec, wanted)

    async def _stop_roles(self) -> None:
        """SIGTERM every role's group (Attention first), SIGKILL what is left after the stop grace."""
        grace = self.plan.options.stop_grace_s
        ordered = sorted(self.roles.values(), key=lambda r: r.spec.role != ATTENTION)
        for role in ordered:
            role.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(r.alive() for r in ordered) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        for role in ordered:
            if role.alive():
                self._say(f"{role.spec.name}: still running after SIGTERM: {role.survivors()}: SIGKILL")
                role.signal_group(signal.SIGKILL)
        for role in ordered:
            await role.close()
        if self.failure is None:  # node 0 hears how they ended (a silent or gone one would not)
            for key in self.roles:
                await self._publish(key)
