"""Start the roles in handshake order, front them with the proxy, stop everything together.

See docs/internals/serve.md, "afd_mrv2.serve.supervisor".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import AfdError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.live_stats import Written
from afd_mrv2.ports import ephemeral_ports, ports_in_ephemeral_range
from afd_mrv2.serve.figures import FiguresReader
from afd_mrv2.serve.metrics import Health, RoleState
from afd_mrv2.serve.plan import CPU_BIND_ENV, Plan, RoleSpec
from afd_mrv2.serve.proxy import Proxy
from afd_mrv2.serve.reaper import Reaper
from afd_mrv2.serve.remote import NodeWatch, RemoteRole
from afd_mrv2.serve.rendezvous import RendezvousHost
from afd_mrv2.serve.roles import POLL_S, RoleProcess, describe_exit
from afd_mrv2.serve.stalls import STALL_LOOK_S, stalled_ffn_ranks

READY_PREFIX = "afd-mrv2 serve: ready at"
KILL_WAIT_S = 2.0
#: After the Attention engines are gone: how long an FFN rank may take to end its session itself,
#: then how long it gets after SIGTERM (both within the stop grace, see ``Supervisor._stop_roles``).
FFN_OWN_END_S = 2.0
FFN_TERM_S = 1.0
EXIT_STOPPED, EXIT_FAILED = 0, 1
#: How long the reaper gives a dead serve's roles between its SIGTERM and its SIGKILL.
REAP_GRACE_S = 5.0
#: While roles start: one line this often naming those not ready yet.
WAITING_SAY_S = 30.0
#: The most restarts of one role rank in one serve run.
MAX_RESTARTS = 3
#: An FFN rank that exits 0 by itself ended its session because its Attention engines were gone: the
#: cause to report is that engine, whose exit its own watcher notices within a poll.  Wait this long for it.
OWN_END_SETTLE_S = 3 * POLL_S


class Supervisor:
    def __init__(self, plan: Plan, *, out: TextIO, log: TextIO) -> None:
        self.plan = plan
        self.out = out
        self.log = log
        self.roles: list[RoleProcess] = []
        self.stopping = False
        self.death: RoleProcess | None = None
        #: roles that died while serve served on and are not back: Attention engines the endpoint routes
        #: around, FFN ranks whose experts their other holders serve
        self.lost: list[RoleProcess] = []
        #: every role that died while serve served on (restarted since or not), for the stop line
        self.gone: list[RoleProcess] = []
        #: restarts per (role, rank) that got ready
        self.restarts: Counter[tuple[str, int]] = Counter()
        self._restart_attempts: Counter[tuple[str, int]] = Counter()
        self._tasks: list[asyncio.Future[None]] = []
        # the store serve hosts (afd.rendezvous: external)
        self.rendezvous = RendezvousHost(plan.afd, plan.options.nodes.store_host(), secret=plan.secret)
        #: the other nodes' heartbeats (over --nnodes; none on one node)
        self.nodes = NodeWatch(self.rendezvous, range(1, plan.options.nodes.nnodes), self._say)
        #: every role's live figures, as each published them in the store
        ranks = [(spec.role, a) for spec in plan.roles for a in spec.afd_ranks]
        self.live = FiguresReader(self.rendezvous, ranks, self._say)
        #: FFN ranks lost and failed over (``afd_ffn_failovers_total``)
        self.failovers = 0
        self.proxy: Proxy | None = None
        self.failure: str | None = None
        self.signal: int | None = None
        self._stop = asyncio.Event()
        self._kill_now = asyncio.Event()
        self._settling = False
        #: stops every role's process group should serve die without stopping them (a SIGKILL)
        self.reaper = Reaper(REAP_GRACE_S)

    def _say(self, text: str) -> None:
        print(f"[serve] {text}", file=self.log, flush=True)

    # ------------------------------------------------------------ events

    def _on_exit(self, role: RoleProcess) -> None:
        if self.stopping or self.death is not None:
            return
        if role.spec.role == ATTENTION and self._degrade(role):
            return
        if role.spec.role == FFN and self._fail_over(role):
            return
        if role.spec.role == FFN and role.returncode == 0:
            if not self._settling:  # its own end: report the Attention engine whose loss caused it, if one went
                self._settling = True
                asyncio.get_running_loop().call_later(OWN_END_SETTLE_S, self._settle, role)
            return
        self.death = role
        self._stop.set()

    def _settle(self, role: RoleProcess) -> None:
        """An FFN rank's own end, reported as the death when no other exit was noticed meanwhile."""
        self._settling = False
        if not self.stopping and self.death is None:
            self.death = role
            self._stop.set()

    def _degrade(self, role: RoleProcess) -> bool:
        """One of several Attention groups (or engines) died: take it out of the endpoint's rotation and serve on
        with the others (the FFN ranks go on serving them: faults are scoped to a peer, or a group, on the vLLM
        path).  A data-parallel group (several ranks: one rank's loss ends its whole vLLM deployment) is
        restarted whole even when it was the only one, unless ``--no-restart-attention`` or its restarts are
        used up.  False when it was the last engine serving, or before every role was ready."""
        proxy = self.proxy
        if proxy is None or not proxy.ready:
            return False
        index = role.spec.rank
        others = [b for i, b in enumerate(proxy.backends) if i != index and b.lost is None]
        group = len(role.spec.afd_ranks) > 1
        restart = self.plan.options.restart_attention
        if not others and not (group and restart and not self._exhausted(role)):
            return False
        reason = f"{role.describe()} exited ({role.describe_exit()})"
        proxy.mark_lost(index, reason)
        self._lose(role)
        role.signal_group(signal.SIGKILL)  # what is left of its group (vLLM's EngineCore, its worker) serves no one
        kind = "groups" if group else "engines"
        if others:
            then = f"the endpoint serves on with {', '.join(b.name for b in others)} ({len(others)} of {len(proxy.backends)} Attention {kind})"
        else:  # a data-parallel group, the only one: its deployment restarts whole, the endpoint answers 503 meanwhile
            then = "no Attention group serves until it is back (503 meanwhile)"
        if group:  # one line says what serve does about a deployment that is gone whole
            if not restart:
                then += "; not restarted (--no-restart-attention)"
            elif not self._exhausted(role):
                then += "; its vLLM deployment restarts whole"
        self._say(f"{reason}: {then}")
        if restart:
            self._restart_later(role)
        return True

    def _lose(self, role: RoleProcess) -> None:
        self.lost.append(role)
        self.gone.append(role)

    def _exhausted(self, role: RoleProcess) -> bool:
        """Whether ``role``'s rank used up its restarts (a lost one is then not started again)."""
        return self._restart_attempts[(role.spec.role, role.spec.rank)] >= MAX_RESTARTS

    def _restart_later(self, role: RoleProcess) -> None:
        key = (role.spec.role, role.spec.rank)
        if role.spec.node in self.nodes.lost:
            self._say(
                f"{role.spec.name}: not restarted ({self.nodes.name(role.spec.node)} is lost); serve runs degraded"
            )
            return
        if self._exhausted(role):
            self._say(
                f"{role.spec.name}: not restarted again ({MAX_RESTARTS} restarts already); serve runs degraded "
                "(afd_role_restarts_exhausted, afd_degraded)"
            )
            return
        self._restart_attempts[key] += 1
        self._tasks.append(asyncio.ensure_future(self._restart(role)))

    async def _restart(self, old: RoleProcess) -> None:
        """Start ``old``'s role again once its group is gone; when ready it is back (an engine rejoins the
        endpoint's rotation; an FFN rank is taken back by the engines at their next step)."""
        await self._wait_dead([old], KILL_WAIT_S)
        if self.stopping:
            return
        spec = old.spec
        if spec.ready_file is not None:
            Path(spec.ready_file).unlink(missing_ok=True)
        started = time.monotonic()
        new = self._new_role(spec, old)
        try:
            await new.start()
        except OSError as exc:
            self._say(f"cannot restart {spec.name}: {exc}")
            return
        self._watch(new)
        self._say(f"{spec.name}: restarting ({new.where()})")
        ready = asyncio.ensure_future(new.ready.wait())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait(
            {ready, stop}, timeout=self.plan.options.ready_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        for task in (ready, stop):
            task.cancel()
        if self.stopping or not new.ready.is_set() or not new.alive():
            return
        if old in self.lost:
            self.lost.remove(old)
        self.restarts[(spec.role, spec.rank)] += 1
        if spec.role == ATTENTION and self.proxy is not None:
            self._route(new)
            self.proxy.revive(spec.rank)
            back = "the endpoint routes to it again"
        else:
            back = "the Attention engines take it back at their next step"
        self._say(f"{new.describe()} restarted: ready after {time.monotonic() - started:.1f} s; {back}")

    async def _watch_stalls(self) -> None:
        """Once a second: an FFN rank an Attention engine stopped routing to while its process runs (a hang,
        SIGSTOP) is stalled; SIGKILL its group, and its exit takes the usual path (failover, restart)."""
        while not self.stopping:
            await asyncio.sleep(STALL_LOOK_S)
            latest = {r.spec.rank: r for r in self.roles if r.spec.role == FFN}
            since = {f: r.started_at for f, r in latest.items() if r.ready.is_set() and r.alive()}
            for f, (engine, reason) in stalled_ffn_ranks(self.figures(), since).items():
                role = latest[f]
                self._say(
                    f"{role.describe()} is stalled: attention rank {engine} stopped routing to it ({reason}) "
                    "while its process runs: SIGKILL"
                )
                role.signal_group(signal.SIGKILL)

    def _fail_over(self, role: RoleProcess) -> bool:
        """An FFN rank died while every expert keeps a live holder (``--expert-replicas`` R >= 2): serve on.
        The Attention engines notice the loss themselves and re-send its share to the other holders.
        False without replicas, when some expert lost its last holder, or before every role was ready."""
        proxy = self.proxy
        if proxy is None or not proxy.ready or self.plan.expert_replicas < 2:
            return False
        lost = [r.spec.rank for r in self.lost if r.spec.role == FFN] + [role.spec.rank]
        placement = self.plan.placement
        if not placement.survives(lost):
            return False
        self._lose(role)
        if role.ready.is_set():  # a restart that died before it was ready lost nothing
            self.failovers += 1
        role.signal_group(signal.SIGKILL)  # what is left of its group serves no one
        live = [f for f in range(placement.num_ffn) if f not in lost]
        self._say(
            f"{role.describe()} exited ({role.describe_exit()}): its experts are served by their other holders, "
            f"FFN rank(s) {', '.join(map(str, live))} ({len(live)} of {placement.num_ffn} live)"
        )
        self.rendezvous.mark_lost(role.spec.role, role.spec.rank)  # an engine starting meanwhile skips it
        if self.plan.options.restart_ffn:
            self._restart_later(role)
        return True

    def _on_signal(self, sig: int) -> None:
        if self.signal is None:
            self.signal = sig
            self._say(f"{signal.Signals(sig).name}: stopping every role")
            self._stop.set()
        else:
            self._say(f"{signal.Signals(sig).name} again: killing every role now")
            self._kill_now.set()

    # ------------------------------------------------------------ the run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        opts = self.plan.options
        names = [(r.name, url) for r, url in zip(self.plan.of(ATTENTION), self.plan.backends, strict=True)]
        per_group = opts.attention // opts.attention_groups
        proxy = self.proxy = Proxy(
            names,
            balance=opts.balance,
            log=self.log,
            num_ffn=opts.ffn,
            roles=self.role_states,
            health=self.health,
            engines=[g * per_group for g in range(opts.attention_groups)],
        )
        self.reaper.start()
        try:
            try:
                await proxy.start(opts.host, opts.port)
            except OSError as exc:
                await proxy.close()
                raise AfdError(f"cannot listen on {opts.host}:{opts.port}: {exc.strerror or exc}") from None
            self._warn_ephemeral()
            self._say_nodes()
            self._say_placement()
            self._say_cores()
            self._say_transport()
            Path(self.plan.run_dir).mkdir(parents=True, exist_ok=True)
            try:
                if (
                    self._host_store()
                    and await self._start(self.plan.of(FFN))
                    and await self._start(self.plan.of(ATTENTION))
                ):
                    proxy.ready = True
                    self._tasks.append(asyncio.ensure_future(self._watch_stalls()))
                    print(f"{READY_PREFIX} http://{opts.host}:{opts.port}/v1", file=self.out, flush=True)
                    await self._stop.wait()
            finally:
                self.stopping = True
                await proxy.fail_all(self._reason())
                self.rendezvous.stop()
                for task in self._tasks:
                    task.cancel()
                await self._stop_roles()
                self.reaper.close()
                await proxy.close()
                shutil.rmtree(self.plan.run_dir, ignore_errors=True)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        return self._report()

    def health(self) -> Health:
        """Failovers, the placement and every role's live figures (``/metrics``, ``/afd/status``)."""
        return Health(
            self.failovers,
            self.plan.expert_replicas,
            tuple(self.plan.placement.describe()),
            self.figures(),
            {f"{role} {rank}": n for (role, rank), n in sorted(self.restarts.items())},
            tuple(sorted({f"{r.spec.role} {r.spec.rank}" for r in self.lost if self._exhausted(r)})),
            tuple(sorted({f"{r.spec.role} {r.spec.rank}" for r in self.lost})),
            self.nodes.state(),
        )

    def figures(self) -> dict[tuple[str, int], Written]:
        """Every role's live figures as it last published them in the store, on any node (a lost node's
        left out: its roles are gone)."""
        lost = {(spec.role, a) for spec in self.plan.roles if spec.node in self.nodes.lost for a in spec.afd_ranks}
        return {key: written for key, written in self.live.figures().items() if key not in lost}

    def _host_store(self) -> bool:
        """Host the AFD rendezvous store (``afd.rendezvous: external``); False, with the failure set, when the
        port cannot be bound."""
        try:
            self.rendezvous.start()
        except AfdError as exc:
            self.failure = str(exc)
            return False
        if self.rendezvous.store is not None:
            self._tasks.append(asyncio.ensure_future(self.live.run()))
        if self.plan.options.nodes.multi:
            self._tasks.append(asyncio.ensure_future(self.nodes.run()))
        return True

    def role_states(self) -> list[RoleState]:
        """The latest process of every role rank started so far, and whether it is live: ready, not lost, its
        process group alive (``/metrics``; a restart is live once it is ready)."""
        latest = {(r.spec.role, r.spec.rank): r for r in self.roles}
        return [
            RoleState(r.spec.role, r.spec.rank, r.pid, r.ready.is_set() and r not in self.lost and r.alive())
            for r in latest.values()
        ]

    def _say_nodes(self) -> None:
        """Over several nodes: which node runs which roles, and where the store is."""
        layout, nodes = self.plan.layout, self.plan.options.nodes
        if layout is None or not nodes.multi:
            return
        self._say(
            f"nodes: {nodes.nnodes}; this is node 0 ({self.plan.addr}); the rendezvous store: {self.rendezvous.where}"
        )
        for line in layout.describe():
            self._say(f"nodes: {line}")

    def _warn_ephemeral(self) -> None:
        """One line when a port bound after the FFN ranks start lies in the kernel's ephemeral range
        (their port-0 sockets may take it first: the Attention engine then fails with EADDRINUSE)."""
        later = self.plan.role_ports
        risky = ports_in_ephemeral_range(later)
        if risky:
            eph = ephemeral_ports()
            self._say(
                f"warning: port(s) {', '.join(map(str, risky))} lie in the kernel's ephemeral range "
                f"{eph.start}-{eph.stop - 1}; another process's socket may take one before its role binds it "
                f"(choose a --port below {eph.start - len(later) - 1})"
            )

    def _say_cores(self) -> None:
        """Where each role runs: its cores, for every process of it (front end, EngineCore, workers)."""
        if CPU_BIND_ENV in os.environ:
            self._say(f"cores: not pinned ({CPU_BIND_ENV} is set in serve's environment)")
            return
        here = sorted(self.plan.local, key=lambda r: (r.role != ATTENTION, r.rank))
        parts = ", ".join(f"{spec.name} -> {','.join(map(str, spec.cores)) or 'any'}" for spec in here)
        free = " ('any': fewer cores than processes, left to the scheduler)" if any(not r.cores for r in here) else ""
        self._say(f"cores: {parts} (every process of a role: its front end, EngineCore and workers){free}")

    def _say_transport(self) -> None:
        """What every pair runs on (``afd.transport``; the roles' sections agree: one base section)."""
        config = parse_afd_config(self.plan.roles[0].afd)
        bind = (
            f", pair sockets bound to {config.bind or 'the route to ' + config.host}"
            if config.transport != "gloo"
            else ""
        )
        self._say(f"transport: {config.transport} (every Attention-FFN pair){bind}")

    def _say_placement(self) -> None:
        """Where the experts live: the table's summary and digest (what every pair checks at its handshake),
        then one line per FFN rank; by block where the expert count is unknown here (more than one FFN rank)."""
        placement = self.plan.placement
        if "placement" in self.plan.afd:
            self._say(f"placement: {placement.summary} ({placement.stamp.short})")
            for line in placement.describe():
                self._say(f"placement: {line}")
            return
        if placement.num_ffn < 2:
            return
        self._say(
            f"placement: {placement.num_experts} expert blocks on {placement.num_ffn} FFN ranks, {placement.replicas} each"
        )
        for line in placement.describe():
            self._say(f"placement: {line.replace('experts', 'blocks')}")

    def _reason(self) -> str:
        if self.death is not None:
            return f"{self.death.describe()} died"
        if self.signal is not None:
            return f"afd-mrv2 serve is stopping ({signal.Signals(self.signal).name})"
        return self.failure or "afd-mrv2 serve is stopping"

    def _report(self) -> int:
        earlier = f" (lost earlier: {', '.join(r.describe() for r in self.gone)})" if self.gone else ""
        if self.death is not None:
            print(
                f"afd-mrv2 serve: error: {self.death.describe()} exited ({self.death.describe_exit()}); "
                f"stopped every role{earlier}",
                file=self.log,
                flush=True,
            )
            return EXIT_FAILED
        if self.failure is not None:
            print(f"afd-mrv2 serve: error: {self.failure}; stopped every role", file=self.log, flush=True)
            return EXIT_FAILED
        name = signal.Signals(self.signal).name if self.signal is not None else "stop"
        self._say(f"stopped every role ({name}){earlier}")
        return EXIT_STOPPED

    async def _start(self, specs: Sequence[RoleSpec]) -> bool:
        """Start ``specs`` and wait until all are ready; False when stopped, a role died or time ran out."""
        started = []
        for spec in specs:
            role = self._new_role(spec, None)
            try:
                await role.start()
            except OSError as exc:
                self.failure = f"cannot start {spec.name}: {exc}"
                return False
            self._watch(role)
            started.append(role)
        ready: asyncio.Future[list[bool]] = asyncio.ensure_future(asyncio.gather(*(r.ready.wait() for r in started)))
        stop: asyncio.Future[bool] = asyncio.ensure_future(self._stop.wait())
        remaining = self.plan.options.ready_timeout_s
        waits: set[asyncio.Future[Any]] = {ready, stop}
        deadline = time.monotonic() + remaining
        while True:  # one line per WAITING_SAY_S naming what is not ready yet: a start that hangs says where
            left = deadline - time.monotonic()
            done, pending = await asyncio.wait(
                waits, timeout=min(WAITING_SAY_S, max(left, 0)), return_when=asyncio.FIRST_COMPLETED
            )
            if done or left <= WAITING_SAY_S:
                break
            self._say(f"waiting {remaining - left + WAITING_SAY_S:.0f} s for: {self._not_ready(started)}")
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if ready in done and not self._stop.is_set():
            for role in started:
                self._route(role)
            self._say(f"{', '.join(r.describe() for r in started)} ready")
            return True
        if not done:
            self.failure = f"{self._not_ready(started)} not ready after {remaining:g} s"
        return False

    def _not_ready(self, roles: Sequence[RoleProcess]) -> str:
        """The roles not ready yet; another node's, with whether that node has joined."""
        parts = []
        for role in roles:
            if role.ready.is_set():
                continue
            if isinstance(role, RemoteRole) and role.spec.node not in self.nodes.info:
                parts.append(
                    f"{role.spec.name} (node {role.spec.node} has not joined the store on {self.rendezvous.where})"
                )
            else:
                parts.append(role.describe())
        return ", ".join(parts)

    def _new_role(self, spec: RoleSpec, previous: RoleProcess | None) -> RoleProcess:
        """A process of ``spec`` to start: here, or (another node's role) through that node's serve, as the
        launch after ``previous``."""
        if spec.node == self.plan.node:
            return RoleProcess(spec, self.log, self._on_exit)
        launch = previous.launch + 1 if isinstance(previous, RemoteRole) else 1
        return RemoteRole(spec, self.log, self._on_exit, rendezvous=self.rendezvous, nodes=self.nodes, launch=launch)

    def _watch(self, role: RoleProcess) -> None:
        """``role`` is started: one of serve's roles, its group stopped by the reaper should serve die."""
        if not isinstance(role, RemoteRole):  # another node's reaper watches that node's roles
            self.reaper.watch(role.pid)
        self.roles.append(role)

    def _route(self, role: RoleProcess) -> None:
        """A ready Attention engine of another node: the endpoint routes to the address it advertised."""
        if isinstance(role, RemoteRole) and role.spec.role == ATTENTION and self.proxy is not None and role.url:
            self.proxy.backends[role.spec.rank].url = role.url

    async def _wait_dead(self, roles: Sequence[RoleProcess], timeout: float) -> list[RoleProcess]:
        """Wait up to ``timeout`` (less on a second signal) for ``roles``' groups to end; return the survivors."""
        deadline = time.monotonic() + timeout
        alive = [r for r in roles if r.alive()]
        while alive and time.monotonic() < deadline and not self._kill_now.is_set():
            await asyncio.sleep(POLL_S / 2)
            alive = [r for r in alive if r.alive()]
        return alive

    async def _stop_roles(self) -> None:
        """Attention engines first, then the FFN ranks, all within about 10 s.

        An FFN rank ends its session by itself once its Attention engines are gone
        (it prints its ``afd-mrv2 ffn: done {...}`` report and exits), so it gets
        :data:`FFN_OWN_END_S` for that before its SIGTERM.  Every window lies within
        the one grace: the FFN ranks get their SIGTERM at the latest :data:`FFN_TERM_S`
        before it ends, and whatever is alive when it ends gets SIGKILL, so a stop takes
        at most grace + KILL_WAIT_S however slowly the Attention engines go (a real
        vLLM engine whose API server was killed takes seconds: its EngineCore waits for
        its worker).
        """
        grace = self.plan.options.stop_grace_s
        deadline = time.monotonic() + grace
        attention = [r for r in self.roles if r.spec.role == ATTENTION]
        ffn = [r for r in self.roles if r.spec.role == FFN]
        for role in attention:
            role.signal_group(signal.SIGTERM)
        survivors = await self._wait_dead(attention, grace - FFN_TERM_S)
        own_end = min(FFN_OWN_END_S, deadline - FFN_TERM_S - time.monotonic())
        survivors += await self._wait_dead(ffn, own_end)
        for role in survivors:
            if role.spec.role == FFN:
                role.signal_group(signal.SIGTERM)
        survivors = await self._wait_dead(survivors, deadline - time.monotonic())
        for role in survivors:
            leader = "running" if role.returncode is None else f"exited ({describe_exit(role.returncode)})"
            self._say(
                f"{role.spec.name}: still running after SIGTERM: {role.survivors()} (its leader, pid {role.pid}, "
                f"{leader}): SIGKILL"
            )
            role.signal_group(signal.SIGKILL)
        self._kill_now.clear()
        for role in await self._wait_dead(survivors, KILL_WAIT_S):
            self._say(f"{role.spec.name}: still alive after SIGKILL: {role.survivors()}")
        for role in self.roles:
            await role.close()
