"""FFN role, serving side: the shared executor's FFN loop around the real routed experts.

No vLLM import here: the FFN worker (:mod:`afd_mrv2.mrv2.extension`) hands
:func:`serve_ffn` one callable per MoE layer, in model order (each is vLLM's own
``RoutedExperts.forward_modular`` of the loaded model: vLLM's loader, quant
method and kernel), and this module runs what every AFD FFN rank runs: the
``p2p_link`` (:mod:`afd_mrv2.mrv2.transport.pairs`), the executor (role ffn) with the
configured connector, driven by :class:`~afd_mrv2.mrv2.ffn.loop.FfnLoop`.

One executor and loop per Attention rank.  On the vLLM path every Attention rank
is an independent engine that steps on its own clock, so the FFN rank serves each
one's items as they arrive: attention rank ``a``'s loop (its own thread, its own
executor, the connector narrowed to that peer with the ``attention_peers``
resource) never waits for another rank's item, and an idle Attention engine
stalls nobody.  The expert computations of all loops take turns on one lock: the
experts are one device's work (one compute stream, or the CPU's cores).

Links: by default each loop runs on a pair of its own, a two-rank group with its
Attention rank's current incarnation (:func:`~afd_mrv2.mrv2.transport.pairs.join_pair`; the
loop's thread joins it, so an engine that starts late stalls only its own loop); with
``AFD_MRV2_P2P_GROUPS=one``, or a ``link`` handed in, every loop shares one link.

Work item ``k`` of an Attention rank (on its pair) has seq ``k``; its MoE layer and stage
identity (``stage i of n``) come from the Attention side's header (torch_p2p's
``follow_stages``): an engine decides alone whether a step is split, so the FFN
side accepts both stage counts, step by step, and checks the order (stages of a
layer in order, layers in order, a new stage count only where a step begins).

Experts on several FFN ranks: FFN rank ``f`` holds ``topology.held_by(f)`` (its
block, and with expert replicas the blocks before it around the ring).  Top-k
entries outside them weigh 0 here, and so do entries the Attention side routed to
another holder (it sends them with weight 0; the Attention side sums the ranks'
partial outputs).  With ``local_experts_only`` the callables hold only those
experts' weights (the worker cut the others away after loading), so ids are also
mapped onto the kept experts' positions (:func:`local_routing`: an entry not
computed here weighs 0 and points at its row's first expert computed here).

An Attention rank that leaves (its process exits or fails) ends the loop serving it:
the connector reports the lost peer and that loop's executor stops.  On pairs or a
scoped link the other loops go on serving their engines, and the session ends when
the last loop ended; on an unscoped one every loop sees the loss within one wait
slice.  With ``afd.rendezvous: external`` (under ``afd-mrv2 serve``) a loop's thread
then waits for its Attention rank's next incarnation (a restarted engine) and serves
it on a new pair; the session ends once the store's stop key is set and every loop
ended.  A loop that
fails on its own (a bad header, say, while its peer lives) aborts the link, which
tells every peer why, and the session ends: the other loops get ``grace_s`` to end,
then the link is aborted again.  :func:`serve_ffn` returns a :class:`FfnReport`
saying how each loop ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.errors import ConfigError, PipelineError
from afd_mrv2.hooks.p2p import P2pShape, PeerAborted, PeerLink, PeerLost
from afd_mrv2.hooks.quant import dequantize_per_token
from afd_mrv2.items import ATTENTION, FFN, WorkItem
from afd_mrv2.live_stats import StatsWriter, stats_path
from afd_mrv2.mrv2.attention.remote import MoeShape
from afd_mrv2.mrv2.ffn.loop import FfnLoop
from afd_mrv2.mrv2.ffn.report import FfnReport, overlap_figures
from afd_mrv2.mrv2.transport.pairs import (
    IDLE_TIMEOUT_S,
    POLL_S,
    connect_store,
    incarnation,
    join_pair,
    label,
    open_peer_link,
    pairs_enabled,
    register,
    stop_requested,
)
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import load_plugins
from afd_mrv2.topology import Topology

#: One MoE layer's routed experts: ``(x [N, H], topk_weights [N, k], topk_ids [N, k] int32) -> [N, H]``.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


#: How often a scoped session checks whether its loops are all done (or one failed on its own).
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
    """The re-sends a loop's connector served (torch_p2p's FFN side counts them; another connector: 0)."""
    return int(getattr(getattr(connector, "side", None), "redispatched", 0))


def local_routing(
    topk_ids: torch.Tensor, weights: torch.Tensor, held: Sequence[int], num_experts: int, *, shift: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and weights as this FFN rank computes them, holding the experts ``held`` (ascending;
    see the module docstring).

    A pair this rank does not compute (its expert is not held here, or the Attention side routed it to
    another holder and sent it with weight 0) weighs 0 and is pointed at the expert of its row's first
    pair computed here: the kernel, which computes every top-k slot, then loads no expert's weights for it
    that the row does not need anyway (with replicas, the other blocks' experts).  A 0-weight slot adds
    exactly 0, so the output is the same.
    """
    if len(held) == num_experts and not shift:
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
    link: PeerLink | None = None,
    local_experts_only: bool = False,
    grace_s: float = 10.0,
) -> FfnReport:
    """Serve ``experts`` to the Attention ranks until they leave; see the module docstring.

    :param max_tokens: the most tokens one Attention forward hands a MoE layer.
    :param dtype: the dtype the experts compute in (the wire carries fp32).
    :param device: where the experts' weights live.
    :param index: this FFN rank's index.
    :param link: an already-open link (tests); by default one is opened on ``afd.host:afd.port``.
    :param local_experts_only: the callables hold only the experts this rank holds.
    :param grace_s: how long the other loops may take to end after the first one ended.
    """
    if not experts:
        raise ValueError("the FFN role needs at least one MoE layer; the loaded model has none")
    topology = Topology(config.num_attention_ranks, config.num_ffn_ranks, shape.num_experts, config.expert_replicas)
    me = topology.global_rank(FFN, index)
    store = None
    if link is None and pairs_enabled():
        store = connect_store(config.host, config.port, master=config.rendezvous == "ffn0" and index == 0)
        incarnation_ = register(store, FFN, index)
    elif link is None:
        link = open_peer_link(topology, me, host=config.host, port=config.port, ffn0_hosts=config.rendezvous == "ffn0")
    block = topology.held_by(index)
    report = FfnReport(moe_layers=len(experts))
    compute_lock = threading.Lock()  # one device: the loops' expert computations take turns

    def compute(
        item: WorkItem,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if scales is not None:  # torch_p2p quant "w8a8": int8 rows and their per-token scales
            hidden = dequantize_per_token(hidden, scales)
        ids, w = local_routing(topk_ids, weights, block, shape.num_experts, shift=local_experts_only)
        with compute_lock, torch.inference_mode():
            start = time.perf_counter()
            out = experts[item.layer_idx](
                hidden.to(device=device, dtype=dtype), w.to(device=device), ids.to(device=device, dtype=torch.int32)
            )
            report.record(hidden.shape[0], time.perf_counter() - start)
        return out

    p2p_shape = P2pShape(shape.hidden_size, shape.top_k, shape.num_experts, len(experts), max_tokens)
    traces: list[Trace] = []
    links: dict[int, PeerLink] = {}  # attention rank -> the link its loop runs on now
    connectors: dict[int, list[object]] = {a: [] for a in range(topology.num_attention)}

    def make_loop(a: int, link: PeerLink) -> FfnLoop:
        peer = topology.global_rank(ATTENTION, a)
        # follow_stages: an engine decides alone whether a step is split, so the stage identity comes from the wire
        resources = {
            "p2p_link": link,
            "model": p2p_shape,
            "attention_peers": [peer],
            "follow_stages": True,
            "on_item": report.item_seen,
        }
        trace = Trace(rank=me, role=FFN, label=f"serving attention rank {a}") if config.multistream.trace else None
        if trace is not None:
            traces.append(trace)
        plugins = load_plugins(config, resources=resources)
        connectors[a].append(plugins.connector)
        links[a] = link
        executor = Executor(
            plugins,
            make_backend(config.multistream.backend),
            config.multistream,
            compute=compute,
            role=FFN,
            trace=trace,
        )
        return FfnLoop(executor, num_layers=len(experts), num_stages=1)

    first_end = threading.Event()
    own_fault = threading.Event()  # a loop failed on its own (not because its peer left): the session ends

    def abort_all(reason: str) -> None:
        for each in list(links.values()):
            each.abort(reason)

    def serve(a: int, loop: FfnLoop) -> None:
        end, abandoned = "stopped", 0
        try:
            while True:
                loop.step()
        except PipelineError as exc:
            end = str(exc).splitlines()[0]
            if left_between_steps(exc):  # a normal stop of the engine: nothing of a step was lost
                end = f"{LEFT_BETWEEN_STEPS}: attention rank {a} closed its connection while no step was in flight"
            elif not isinstance(exc.__cause__, (PeerLost, PeerAborted)):  # this rank found the fault (a bad header...):
                own_fault.set()
                abort_all(f"FFN rank {index} stopped serving: {end}")  # tell the Attention ranks why, now
        finally:
            try:
                abandoned = len(loop.close().abandoned)
            finally:
                report.loop_ended(a, loop.submitted - abandoned, end, loop.executor, _redispatched(connectors[a][-1]))
                first_end.set()

    rejoin = store is not None and config.rendezvous == "external"

    def attend(a: int) -> None:
        """Pairs: serve Attention rank ``a``'s incarnations, each on a pair of its own; with ``rejoin``
        the next one after the last left (a restarted engine), until the store says stop.  A store that
        stops answering (its host is gone: serve stopped) ends the wait for the next one."""
        try:
            attend_incarnations(a)
        except (RuntimeError, OSError) as exc:
            report.waiting_ended(a, f"the rendezvous store stopped answering: {str(exc).splitlines()[0]}")

    def attend_incarnations(a: int) -> None:
        assert store is not None
        served = 0

        def done() -> bool:
            return own_fault.is_set() or (rejoin and stop_requested(store))

        while not done():
            i = incarnation(store, ATTENTION, a)
            if i <= served:
                if served and not rejoin:
                    return
                time.sleep(POLL_S)
                continue
            pair = join_pair(
                store,
                FFN,
                (a, i),
                (index, incarnation_),
                give_up=lambda i=i: done() or incarnation(store, ATTENTION, a) != i,  # type: ignore[misc]
            )
            if pair is None:
                continue
            peer = topology.global_rank(ATTENTION, a)
            labels = {peer: label(store, ATTENTION, a, i), me: label(store, FFN, index, incarnation_)}
            serve(a, make_loop(a, PeerLink(topology, me, pairs={peer: pair}, labels=labels, scoped=True)))
            served = i
            if not rejoin:
                return

    if store is None:
        assert link is not None
        loops = [make_loop(a, link) for a in range(topology.num_attention)]
        targets = [(serve, (a, loop)) for a, loop in enumerate(loops)]
    else:
        targets = [(attend, (a,)) for a in range(topology.num_attention)]
    threads = [
        threading.Thread(target=target, args=args, name=f"afd-ffn{index}-serves-attention{a}", daemon=True)
        for a, (target, args) in enumerate(targets)
    ]
    started = time.monotonic()

    def live() -> dict[str, Any]:
        redispatched = sum(_redispatched(c) for each in connectors.values() for c in each)
        return {**report.live(), "redispatched": redispatched, "up_s": round(time.monotonic() - started, 3)}

    figures = StatsWriter(stats_path(FFN, index), live)
    for thread in threads:
        thread.start()
    if store is not None or (link is not None and link.scoped):
        # each loop ends when its own engine leaves; the session, when the last one did
        while not own_fault.wait(SESSION_POLL_S) and any(thread.is_alive() for thread in threads):
            figures.maybe_write()
    else:
        while not first_end.wait(SESSION_POLL_S):
            figures.maybe_write()
    figures.maybe_write(force=True)
    deadline = time.monotonic() + grace_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        abort_all(f"FFN rank {index} stopped serving: {report.end}")
        for thread in threads:
            thread.join(grace_s)
    if config.multistream.trace:
        report.add_overlap(overlap_figures(traces))
    return report
