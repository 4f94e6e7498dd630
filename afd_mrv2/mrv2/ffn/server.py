"""FFN role, serving side: the shared executor's FFN loop around the real routed experts.

:class:`FfnServer`, :func:`serve_ffn`, :class:`FfnReport`, :func:`local_routing`.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.ffn.server".
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import torch

from afd_mrv2.api import ffn_failover_of
from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.errors import ConfigError, PipelineError
from afd_mrv2.hooks.p2p import P2pShape, PeerAborted, PeerLink, PeerLost
from afd_mrv2.hooks.p2p.ffn import FfnSide
from afd_mrv2.hooks.p2p.link import Pair
from afd_mrv2.hooks.p2p.torch_p2p import TorchP2pConnector
from afd_mrv2.hooks.quant import dequantize_per_token
from afd_mrv2.items import ATTENTION, FFN, WorkItem
from afd_mrv2.live_stats import FfnFigures, FiguresPublisher, Written, encode
from afd_mrv2.mrv2.ffn.loop import FfnLoop
from afd_mrv2.mrv2.ffn.report import FfnReport, overlap_figures
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.mrv2.transport.store import IDLE_TIMEOUT_S, POLL_S, PairTransport, PlacementMismatch, RendezvousStore
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import FfnContext, load_plugins
from afd_mrv2.topology import Topology

#: One MoE layer's routed experts: ``(x [N, H], topk_weights [N, k], topk_ids [N, k] int32) -> [N, H]``.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: The Attention ranks of one lock-step group (``AfdConfig.attention_groups``): one loop serves them.
Group = tuple[int, ...]


def _name(group: Group) -> str:
    """``attention rank 0`` or ``attention group 0-1`` (ranks), for messages and thread names."""
    if len(group) == 1:
        return f"attention rank {group[0]}"
    return f"attention group {group[0]}-{group[-1]}"


def ffn_serving_config(raw_afd: Mapping[str, Any]) -> AfdConfig:
    """Parse the FFN role's ``afd`` section for serving.

    A serving FFN rank waits for the next item as long as its Attention engine is
    idle, so torch_p2p's ``recv_timeout_s`` defaults to a week here (a dead
    Attention process is still noticed at once, through the link's control
    channel); an explicit value is kept.
    """
    raw = dict(raw_afd)
    if raw.get("connector") == "torch_p2p":
        extra = dict(raw.get("connector_extra_config") or {})
        extra.setdefault("recv_timeout_s", IDLE_TIMEOUT_S)
        raw["connector_extra_config"] = extra
    config = parse_afd_config(raw)
    if config.role != FFN:
        raise ConfigError("afd.role", f"expected ffn for the FFN role process, got {config.role!r}")
    return config


#: How often a session checks whether its loops are all done (or one failed on its own).
SESSION_POLL_S = 0.2
#: How a session's ``end`` starts when an Attention engine went away at a step boundary (its normal stop).
LEFT_BETWEEN_STEPS = "left between steps"


def left_between_steps(error: PipelineError) -> bool:
    """True when the loop ended because its Attention engine's connection closed while this rank waited for
    the first item of a step: the engine stopped (or died) with no step in flight, so nothing was lost here.

    The FFN executor submits a step's items ahead of their arrival, so the failed item is the earliest one
    still in flight; it is the step's first (layer 0, stage 0) only when every earlier item completed.
    """
    item = error.item
    return (
        isinstance(error.__cause__, PeerLost)
        and error.phase == "recv"
        and item is not None
        and item.layer_idx == 0
        and item.stage_idx == 0
    )


def _redispatched(connector: object) -> int:
    """The re-sends a loop's connector served (:class:`~afd_mrv2.api.FfnFailover`; a connector without
    failover: 0)."""
    resends = ffn_failover_of(connector)
    return 0 if resends is None else resends.redispatched


def _round_trip_stamps(connector: object) -> dict[str, Any] | None:
    """A loop's torch_p2p FFN side's stamps (``FfnStamps.as_dict()``, docs/internals/p2p-transport.md), or
    None for another connector."""
    if isinstance(connector, TorchP2pConnector) and isinstance(connector.side, FfnSide):
        return connector.side.stamps.as_dict()
    return None


def local_routing(
    topk_ids: torch.Tensor, weights: torch.Tensor, held: Sequence[int], num_experts: int, *, shift: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and weights as this FFN rank computes them, holding the experts ``held`` (ascending;
    see docs/internals/vllm-roles.md).

    A pair this rank does not compute (its expert is not held here, or the Attention side routed it to
    another holder and sent it with weight 0) weighs 0 and is pointed at the expert of its row's first
    pair computed here: the kernel, which computes every top-k slot, then loads no expert's weights for it
    that the row does not need anyway (with replicas, the other blocks' experts).  A 0-weight slot adds
    exactly 0, so the output is the same.

    A rank that holds every expert (``held`` ascending: ``0 .. num_experts - 1``, so a shift changes no id)
    only looks for 0-weight pairs, with one operation: this runs next to the MoE compute on every item,
    where each small torch operation costs tens of us (docs/internals/vllm-roles.md).
    """
    if len(held) == num_experts:  # every expert held: the ids are already the held positions
        if bool(weights.all()):  # no 0-weight pair (one without replicas never gets one)
            return topk_ids, weights
        mine = weights != 0
    else:
        position = torch.full((num_experts,), -1, dtype=torch.long)
        position[torch.tensor(list(held), dtype=torch.long)] = torch.arange(len(held))
        local = position[topk_ids.long()]
        mine = (local >= 0) & (weights != 0)
        if shift:
            topk_ids = torch.where(local >= 0, local, torch.zeros_like(local)).to(topk_ids.dtype)
    if bool(mine.all()):
        return topk_ids, weights
    first = mine.to(torch.uint8).argmax(dim=1, keepdim=True)  # a row's first computed pair (0 when it has none)
    filler = topk_ids.gather(1, first).expand_as(topk_ids)
    return torch.where(mine, topk_ids, filler), weights * mine


def serve_ffn(
    config: AfdConfig,
    experts: Sequence[ExpertsFn],
    shape: MoeShape,
    *,
    max_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    index: int = 0,
    local_experts_only: bool = False,
    grace_s: float = 10.0,
) -> FfnReport:
    """Serve ``experts`` to the Attention ranks until they leave; see docs/internals/vllm-roles.md.

    :param max_tokens: the most tokens one Attention forward hands a MoE layer.
    :param dtype: the dtype the experts compute in (the wire carries fp32).
    :param device: where the experts' weights live.
    :param index: this FFN rank's index.
    :param local_experts_only: the callables hold only the experts this rank holds.
    :param grace_s: how long the other loops may take to end after one failed on its own.
    """
    server = FfnServer(
        config,
        experts,
        shape,
        max_tokens=max_tokens,
        dtype=dtype,
        device=device,
        index=index,
        local_experts_only=local_experts_only,
        grace_s=grace_s,
    )
    return server.run()


@final
class FfnServer:
    """One FFN rank's serving session (see docs/internals/vllm-roles.md), in named steps: :meth:`run` opens the
    rendezvous store and registers this process (:meth:`open`), starts one thread per Attention group in
    :meth:`attend` (its incarnations, each served by one loop from :meth:`make_loop` in :meth:`serve` over
    every rank of the group), then waits for the session (:meth:`wait`) and ends it (:meth:`shut_down`).
    The parameters are :func:`serve_ffn`'s.
    """

    __slots__ = (
        "_compute_lock",
        "_connectors",
        "_links",
        "_own_fault",
        "_p2p_shape",
        "_started",
        "_traces",
        "block",
        "config",
        "device",
        "dtype",
        "experts",
        "grace_s",
        "incarnation",
        "index",
        "local_experts_only",
        "me",
        "rejoin",
        "report",
        "shape",
        "store",
        "topology",
    )

    #: the rendezvous store (:meth:`open`)
    store: RendezvousStore
    #: this process's incarnation, registered in the store (:meth:`open`)
    incarnation: int

    def __init__(
        self,
        config: AfdConfig,
        experts: Sequence[ExpertsFn],
        shape: MoeShape,
        *,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        index: int,
        local_experts_only: bool,
        grace_s: float,
    ) -> None:
        if not experts:
            raise ValueError("the FFN role needs at least one MoE layer; the loaded model has none")
        self.config = config
        self.experts = experts
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.index = index
        self.local_experts_only = local_experts_only
        self.grace_s = grace_s
        self.topology = Topology.over(config.num_attention_ranks, config.placement_for(shape.num_experts))
        self.me = self.topology.global_rank(FFN, index)
        self.block = self.topology.held_by(index)
        #: with ``afd.rendezvous: external``: serve each Attention rank's next incarnation too, until stop
        self.rejoin = config.rendezvous == "external"
        self.report = FfnReport(moe_layers=len(experts))
        self._compute_lock = threading.Lock()  # one device: the loops' expert computations take turns
        self._p2p_shape = P2pShape(shape.hidden_size, shape.top_k, shape.num_experts, len(experts), max_tokens)
        self._traces: list[Trace] = []
        self._links: dict[Group, PeerLink] = {}  # attention group -> the link its loop runs on now
        self._connectors: dict[Group, list[object]] = {group: [] for group in config.attention_groups}
        self._own_fault = threading.Event()  # a loop failed on its own (not because its peer left): the end
        self._started = time.monotonic()

    # ------------------------------------------------------------------ the session

    def run(self) -> FfnReport:
        """Serve every Attention group until the session ends; the report."""
        self.open()
        threads = [
            threading.Thread(
                target=self.attend, args=(group,), name=f"afd-ffn{self.index}-serves-{_name(group)}", daemon=True
            )
            for group in self.config.attention_groups
        ]
        self._started = time.monotonic()
        figures = FiguresPublisher(FFN, self._publish_live, self.live)
        figures.start()
        for thread in threads:
            thread.start()
        self.wait(threads, figures)
        return self.shut_down(threads)

    def open(self) -> None:
        """Connect to the rendezvous store (FFN rank 0 hosts it with ``afd.rendezvous: ffn0``) and register
        this process as the next incarnation of its rank."""
        config = self.config
        self.store = RendezvousStore.connect(
            config.host,
            config.port,
            master=config.rendezvous == "ffn0" and self.index == 0,
            transport=PairTransport.of(config),
        )
        self.incarnation = self.store.register(FFN, self.index)

    def wait(self, threads: Sequence[threading.Thread], figures: FiguresPublisher) -> None:
        """Until every loop ended (each when its own engine leaves) or one failed on its own; the live
        figures are published meanwhile (every second, by ``figures``' thread), and once more at the end."""
        while not self._own_fault.wait(SESSION_POLL_S) and any(thread.is_alive() for thread in threads):
            pass
        figures.stop()

    def _publish_live(self, written: Written) -> None:
        self.store.publish_live(FFN, self.index, encode(written))

    def shut_down(self, threads: Sequence[threading.Thread]) -> FfnReport:
        """The loops get ``grace_s`` to end, then their links are aborted; the report, with the traces' overlap."""
        deadline = time.monotonic() + self.grace_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            self.abort_all(f"FFN rank {self.index} stopped serving: {self.report.end}")
            for thread in threads:
                thread.join(self.grace_s)
        if self.config.multistream.trace:
            self.report.add_overlap(overlap_figures(self._traces))
        return self.report

    def abort_all(self, reason: str) -> None:
        """Abort every loop's current link: each peer learns ``reason``."""
        for link in list(self._links.values()):
            link.abort(reason)

    def live(self) -> FfnFigures:
        """What serve's ``/metrics`` shows of this rank (:mod:`afd_mrv2.live_stats`)."""
        redispatched = sum(_redispatched(c) for each in self._connectors.values() for c in each)
        return self.report.figures(redispatched=redispatched, up_s=round(time.monotonic() - self._started, 3))

    # ------------------------------------------------------------------ one Attention group

    def attend(self, group: Group) -> None:
        """Serve an Attention group's incarnations (on this rank's thread for it: one lock-step vLLM deployment's
        ranks, or one engine); a store that stops answering (its host is gone: serve stopped) ends the wait for
        the next one."""
        try:
            self._attend_incarnations(group)
        except PlacementMismatch as exc:  # the tables differ: the session ends, the line on both sides
            for a in group:
                self.report.waiting_ended(a, str(exc))
            self._own_fault.set()
            raise
        except (RuntimeError, OSError) as exc:
            for a in group:
                self.report.waiting_ended(a, f"the rendezvous store stopped answering: {str(exc).splitlines()[0]}")

    def _attend_incarnations(self, group: Group) -> None:
        """Each incarnation of the group on pairs of its own: the first one, and with ``rejoin`` the next one after
        the last left (a restarted engine: every rank of a group restarts with it), until the session is done."""
        served = dict.fromkeys(group, 0)
        while not self._done():
            latest = {a: self.store.latest(ATTENTION, a) for a in group}
            if any(latest[a] <= served[a] for a in group):
                time.sleep(POLL_S)
                continue
            link = self._group_link(group, latest)
            if link is None:
                continue
            self.serve(group, self.make_loop(group, link))
            served = latest
            if not self.rejoin:
                return

    def _group_link(self, group: Group, incarnations: Mapping[int, int]) -> PeerLink | None:
        """A link on the pairs with the given incarnation of each rank of ``group``, None when the session ended
        or a newer incarnation came first (the pairs joined so far are closed)."""
        pairs: dict[int, Pair] = {}
        labels = {self.me: self.store.label(FFN, self.index, self.incarnation)}
        for a in group:
            i = incarnations[a]
            pair = self.store.join_pair(
                FFN,
                (a, i),
                (self.index, self.incarnation),
                placement=self.topology.placement.stamp,
                give_up=functools.partial(self._moved_on, a, i),
            )
            if pair is None:
                for joined in pairs.values():
                    joined.channel.close()
                return None
            peer = self.topology.global_rank(ATTENTION, a)
            pairs[peer] = pair
            labels[peer] = self.store.label(ATTENTION, a, i)
        return PeerLink(self.topology, self.me, pairs=pairs, labels=labels)

    def _moved_on(self, a: int, i: int) -> bool:
        return self._done() or self.store.latest(ATTENTION, a) != i

    def _done(self) -> bool:
        """No new loop starts: a loop failed on its own, or (``rejoin``) the store says stop."""
        return self._own_fault.is_set() or (self.rejoin and self.store.stop_requested())

    # ------------------------------------------------------------------ one loop

    def make_loop(self, group: Group, link: PeerLink) -> FfnLoop:
        """The loop serving ``group`` on ``link``: its own connector and executor; each item is one expert
        computation over the rows of every rank of the group (M:N)."""
        peers = [self.topology.global_rank(ATTENTION, a) for a in group]
        # follow_stages: an engine decides alone whether a step is split, so the stage identity comes from the wire
        context = FfnContext(
            config=self.config,
            p2p_link=link,
            model=self._p2p_shape,
            attention_peers=peers,
            follow_stages=True,
            on_item=self.report.item_seen,
            on_rows=self.report.rows_seen,
        )
        trace = None
        if self.config.multistream.trace:
            trace = Trace(rank=self.me, role=FFN, label=f"serving {_name(group)}")
            self._traces.append(trace)
        plugins = load_plugins(context)
        self._connectors[group].append(plugins.connector)
        self._links[group] = link
        ms = self.config.multistream
        executor = Executor(plugins, make_backend(ms.backend), ms, compute=self.compute, role=FFN, trace=trace)
        return FfnLoop(executor, num_layers=len(self.experts), num_stages=1)

    def serve(self, group: Group, loop: FfnLoop) -> None:
        """Run ``loop`` until it ends and record how it ended; a loop that failed on its own (not because a peer
        left) ends the session and tells every Attention rank why, at once."""
        end = "stopped"
        try:
            while True:
                loop.step()
        except PipelineError as exc:
            end = str(exc).splitlines()[0]
            if left_between_steps(exc):  # a normal stop of the engine: nothing of a step was lost
                end = f"{LEFT_BETWEEN_STEPS}: {_name(group)} closed its connection while no step was in flight"
            elif not isinstance(exc.__cause__, (PeerLost, PeerAborted)):  # this rank found the fault (a bad header...)
                self._own_fault.set()
                self.abort_all(f"FFN rank {self.index} stopped serving: {end}")
        finally:
            self._loop_ended(group, loop, end)

    def _loop_ended(self, group: Group, loop: FfnLoop, end: str) -> None:
        abandoned = 0
        try:
            abandoned = len(loop.close().abandoned)
            link = self._links.get(group)
            if link is not None:
                link.release()
        finally:
            served = loop.submitted - abandoned
            connector = self._connectors[group][-1]
            stamps = _round_trip_stamps(connector)
            resent = _redispatched(connector)
            for i, a in enumerate(group):  # every item of a group loop carried a message of each of its ranks
                self.report.loop_ended(a, served, end, loop.executor, resent if i == 0 else 0)
                if stamps is not None:
                    self.report.loop_stamps(a, stamps)

    def compute(
        self,
        item: WorkItem,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The executor's compute: one MoE layer's routed experts for an item, as this rank computes them."""
        if scales is not None:  # torch_p2p quant "w8a8": int8 rows and their per-token scales
            hidden = dequantize_per_token(hidden, scales)
        ids, w = local_routing(topk_ids, weights, self.block, self.shape.num_experts, shift=self.local_experts_only)
        device = self.device
        with self._compute_lock, torch.inference_mode():
            start = time.perf_counter()
            out = self.experts[item.layer_idx](
                hidden.to(device=device, dtype=self.dtype),
                w.to(device=device),
                ids.to(device=device, dtype=torch.int32),
            )
            self.report.record(hidden.shape[0], time.perf_counter() - start)
        return out
