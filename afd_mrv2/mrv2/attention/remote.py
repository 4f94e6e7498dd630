"""Attention role, model side: each routed-experts call of a vLLM MoE layer as one AFD transfer.

:class:`RemoteExperts` and the opaque custom op :func:`remote_routed_experts`.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.attention.remote".
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from afd_mrv2.admission import Subject, run
from afd_mrv2.api import AttentionFailover, FailoverRecord, failover_of
from afd_mrv2.config import AUTO, AfdConfig, MultistreamConfig
from afd_mrv2.devices import DeviceBackend, Stream, make_backend
from afd_mrv2.devices.accelerator import accelerator_available
from afd_mrv2.errors import ConfigError, PipelineError, PluginError
from afd_mrv2.hooks.p2p import P2pShape, PeerLink
from afd_mrv2.hooks.p2p.roundtrip import RoundTripAttentionSide
from afd_mrv2.hooks.p2p.torch_p2p import TorchP2pConnector
from afd_mrv2.items import ATTENTION, WorkItem
from afd_mrv2.live_stats import AttentionFigures, FailoverFigures, FiguresPublisher, Histogram, Written, encode
from afd_mrv2.mrv2.attention.exchange import UBatchExchange
from afd_mrv2.mrv2.attention.handoff import Handoff, SiblingFailed, SplitStep, current_step
from afd_mrv2.mrv2.attention.overlap import OverlapMeter
from afd_mrv2.mrv2.attention.rows import RowShare
from afd_mrv2.mrv2.memory import current_memory
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.mrv2.transport.pairs import AttentionLinkOpening
from afd_mrv2.mrv2.transport.rejoin import Rejoiner, route_around_missing
from afd_mrv2.pipeline.executor import CloseReport, Executor
from afd_mrv2.plugins import AttentionContext, Plugins, load_plugins
from afd_mrv2.stages.layout import decide_split, layout_line, layout_log_enabled, step_layouts, unsplit_stage
from afd_mrv2.topology import Topology

OP_NAME = "afd_mrv2::remote_routed_experts"


def attention_backend(multistream: MultistreamConfig) -> str:
    """The stream backend of this side's executor: ``multistream.backend``, except that ``auto`` on a
    CPU for a serialized executor (the Attention role not in ``multistream.roles``) is ``inline``.

    The caller is the model's thread (a micro-batch thread in a split step).  On the host
    backend the executor's one stream is a thread of its own that competes with the model,
    and in a split step with the sibling micro-batch computing meanwhile, for the engine's
    core and the GIL, so each dispatch would leave late; inline, ``start`` returns with the
    dispatch on the wire (:mod:`afd_mrv2.devices.inline`).
    """
    name = multistream.backend
    if name == AUTO and not multistream.active_for(ATTENTION) and not accelerator_available():
        return "inline"
    return name


def check_vllm_path(config: AfdConfig) -> None:
    """Refuse, in one line naming the key, what the vLLM MoE seam cannot do: the admission check
    ``router-on-attention`` (:mod:`afd_mrv2.admission`; ``admit`` already runs it in every vLLM process)."""
    run(Subject(config), names=("router-on-attention",))


def _lost(topology: Topology, failover: AttentionFailover) -> set[int]:
    """The FFN ranks the connector no longer routes to (the rejoiner watches the store for their comeback)."""
    return set(range(topology.num_ffn)) - set(failover.live)


def _identity(item: WorkItem, routed: Any) -> Any:
    """The Attention executor's compute: nothing between the router and the dispatch."""
    del item
    return routed


@dataclass
class _Session:
    link: PeerLink
    plugins: Plugins
    backend: DeviceBackend
    executor: Executor
    exchange: UBatchExchange
    #: the connector's Attention-side failover (:func:`~afd_mrv2.api.failover_of`), or None where it has none
    failover: AttentionFailover | None = None
    rejoiner: Rejoiner | None = None

    @property
    def failover_log(self) -> FailoverRecord | None:
        """What the connector's failovers did, or None where it does not fail over."""
        return None if self.failover is None else self.failover.failovers


class RemoteExperts:
    """The Attention process's AFD side; see docs/internals/vllm-roles.md.

    :param config: the parsed ``afd`` section (role attention).
    :param max_tokens: the most tokens one forward hands a MoE layer (vLLM's
        ``max_num_batched_tokens``): sizes the connector's buffers.
    :param handoff: vLLM's micro-batch hand-off functions; None where no step is
        ever split (every call is then stage ``0 of 1``).
    :param open_early: open the link on a thread of its own once the first MoE layer is registered
        (:class:`~afd_mrv2.mrv2.transport.pairs.AttentionLinkOpening`; what vLLM's process does,
        :func:`attach`), not at the first transfer.
    :param share: which rows of each call this process sends (its real tokens, its TP share): all by default.
    """

    def __init__(
        self,
        config: AfdConfig,
        *,
        max_tokens: int,
        handoff: Handoff | None = None,
        open_early: bool = False,
        share: RowShare | None = None,
    ) -> None:
        check_vllm_path(config)
        self.config = config
        self.max_tokens = max_tokens
        self.handoff = handoff
        self.share = share or RowShare()
        self.meter = OverlapMeter()
        self.items_by_stage_count: Counter[int] = Counter()  # stage count n -> items sent with it
        self._resumed_ns = 0  # unsplit steps: when the model last got back to compute
        self._layers: dict[int, MoeShape] = {}  # model layer index -> shape, as constructed
        self._order: list[int] = []  # model layer indices, sorted (set on the first call)
        self._session: _Session | None = None
        self._open_early = open_early
        self._opening: AttentionLinkOpening | None = None
        self._failover_record: dict[str, Any] | None = None
        self._stamps_record: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self.tokens: Counter[int] = Counter()  # tokens per call -> calls (for tests and reports)
        self.steps = 0  # forwards seen (calls of the first MoE layer)
        self.round_trips = Histogram()  # seconds from dispatch to the combined result, per call
        self._failovers_seen = 0
        # through the store every second, on a thread of its own: current after a burst, never on the model's thread
        self._live = FiguresPublisher(ATTENTION, self._publish_live, self.live_stats)
        self._live.start()

    def add_layer(self, layer_index: int, shape: MoeShape) -> None:
        """Register a MoE layer at construction (every layer before the first call)."""
        if self._session is not None:
            raise RuntimeError(f"MoE layer {layer_index} constructed after the AFD transfers started")
        first = next(iter(self._layers.values()), shape)
        if shape != first:
            raise ValueError(f"MoE layer {layer_index} has shape {shape}, the others {first}: AFD needs one shape")
        self._layers[layer_index] = shape
        if self._open_early and self._opening is None:
            config = self.config
            self._opening = AttentionLinkOpening(config, self._topology(shape))

    def _topology(self, moe: MoeShape) -> Topology:
        config = self.config
        return Topology.over(config.num_attention_ranks, config.placement_for(moe.num_experts))

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def calls(self) -> int:
        return sum(self.tokens.values())

    def split_step(self) -> SplitStep | None:
        """The split step the calling thread is a micro-batch of, or None (unsplit)."""
        if self.handoff is None or not self.handoff.active():
            return None
        return current_step()

    def step_started(self) -> None:
        """An unsplit forward begins (the runner): the model computes from now on."""
        self._resumed_ns = time.perf_counter_ns()

    def exchange(
        self, layer_index: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' output for ``x``, computed by the FFN role for this process's rows (its real
        tokens, its TP share: :class:`RowShare`); zeros on every other row (see docs/internals/vllm-roles.md)."""
        start, stop = self.share.span(x.shape[0])
        if (start, stop) == (0, x.shape[0]):
            return self._round_trip(layer_index, x, topk_weights, topk_ids)
        part = self._round_trip(layer_index, x[start:stop], topk_weights[start:stop], topk_ids[start:stop])
        out = torch.zeros_like(x)
        out[start:stop] = part
        return out

    def _round_trip(
        self, layer_index: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        session = self._open()
        ordinal = self._order.index(layer_index)
        step = self.split_step()
        if step is None:
            ubatch, stage = 0, (0, 1)
        else:
            assert self.handoff is not None
            ubatch = self.handoff.current()
            stage = (ubatch, step.num_ubatches)
            step.check(ubatch)  # a sibling failed: start nothing more
        if ordinal == 0 and ubatch == 0:  # the first MoE layer's first stage: a new engine step
            if session.rejoiner is not None and session.failover is not None:  # a step boundary: take back
                session.rejoiner.take_back(session.link, session.failover)  # restarted FFN ranks
            self.steps += 1
            if layout_log_enabled():
                self._log_layout(x.shape[0], stage[1])
        now = time.perf_counter_ns()
        resumed = self._resumed_ns if step is None else step.resumed_ns.get(ubatch, now)
        self.meter.compute(ubatch, resumed or now, now)
        ticket = session.exchange.start(ordinal, (x, topk_ids, topk_weights), stage=stage)
        self.items_by_stage_count[stage[1]] += 1
        if step is not None:
            try:
                step.hand_over(ubatch)
            except SiblingFailed:
                session.exchange.finish(ticket)  # leave no transfer half-done, then end this micro-batch
                raise
        out, delivered_ns = session.exchange.finish_timed(ticket)
        self.meter.round_trip(ubatch, ticket.started_ns, delivered_ns)
        self.round_trips.observe(max(0, delivered_ns - ticket.started_ns) / 1e9)
        if step is None:
            self._resumed_ns = time.perf_counter_ns()
        else:
            step.resumed(ubatch)
        tokens = x.shape[0]
        self.tokens[tokens] += 1
        log = session.failover_log
        failovers = log.count if log is not None else 0
        if failovers != self._failovers_seen:
            self._live.nudge()  # a failover is shown at once
        self._failovers_seen = failovers
        routed: torch.Tensor = out.to(device=x.device, dtype=x.dtype)  # the connector's result is untyped
        return routed

    def _publish_live(self, written: Written) -> None:
        """Into the rendezvous store, once the link's opening reached it (nothing to show before)."""
        store = self._opening.store if self._opening is not None else None
        if store is not None:
            store.publish_live(ATTENTION, self.config.rank, encode(written))

    def live_stats(self) -> AttentionFigures:
        """What serve's ``/metrics`` shows of this engine (:mod:`afd_mrv2.live_stats`)."""
        round_trip_s, hidden_s = self.meter.totals_s()
        failover = self.failovers()  # the connector's FailoverLog.as_dict(): FailoverFigures' document
        return AttentionFigures(
            calls=self.calls,
            tokens=sum(t * n for t, n in self.tokens.items()),
            round_trip_seconds=self.round_trips.figures(),
            round_trip_total_s=round_trip_s,
            hidden_total_s=hidden_s,
            failover=None if failover is None else FailoverFigures.from_dict(failover, "failover"),
            memory=current_memory(),
        )

    def _log_layout(self, tokens: int, stages: int) -> None:
        """``AFD_MRV2_LAYOUT_LOG``: the step's one stage (this path forms no async-MoE stages).

        Each engine steps alone (no DP group here), so it decides alone:
        :func:`~afd_mrv2.stages.layout.decide_split` without an exchange; there is
        no planner on this path, so the step runs as one stage.
        """
        if stages > 1:  # a split step: the runner knows its micro-batches' rows
            return
        decision = decide_split(False, tokens, 0)
        (layout,) = step_layouts(
            [unsplit_stage([tokens])], dp_max_tokens=decision.dp_max_tokens, layout="tp", tp_size=1, tp_rank=0
        )
        why = "no async-MoE stages on the vLLM MoE seam; this engine decides alone"
        line = layout_line(f"attention rank {self.config.rank}", self.steps - 1, layout, split="none", why=why)
        sys.stderr.flush()
        os.write(2, f"{line}\n".encode())

    def _open(self) -> _Session:
        with self._lock:
            if self._session is None:
                self._session = self._build()
            return self._session

    def _build(self) -> _Session:
        if not self._layers:
            raise RuntimeError("no MoE layer was registered before the first AFD transfer")
        self._order = sorted(self._layers)
        moe = next(iter(self._layers.values()))
        config = self.config
        topology = self._topology(moe)
        opening = self._opening = self._opening or AttentionLinkOpening(config, topology)
        store, link, me, joined = opening.wait()
        shape = P2pShape(moe.hidden_size, moe.top_k, moe.num_experts, len(self._order), self.max_tokens)
        exchange = UBatchExchange()
        context = AttentionContext(
            config=config, p2p_link=link, model=shape, source=exchange.source, sink=exchange.sink
        )
        plugins = load_plugins(context)
        backend = make_backend(attention_backend(config.multistream))
        executor = Executor(plugins, backend, config.multistream, compute=_identity, role=ATTENTION)
        exchange.bind(executor)
        failover = failover_of(plugins.connector)  # None: the connector cannot route around a lost FFN rank
        route_around_missing(link, failover)
        rejoiner = None
        if config.rendezvous == "external" and config.expert_replicas > 1 and failover is not None:
            lost = functools.partial(_lost, topology, failover)
            rejoiner = Rejoiner(store, topology, config.rank, me, joined, lost, link=link)
        return _Session(link, plugins, backend, executor, exchange, failover, rejoiner)

    def create_streams(self, roles: tuple[str, ...]) -> tuple[DeviceBackend, dict[str, Stream]]:
        """Streams for ``roles`` from the connector's ``create_streams`` hook, on this session's
        backend (the micro-batch runner's compute and comm streams); opens the session."""
        session = self._open()
        ms = self.config.multistream
        config = ms if ms.active_for(ATTENTION) else replace(ms, enabled=False)
        try:
            return session.backend, session.plugins.create_streams(session.backend, roles, config)
        except PluginError as exc:
            raise PipelineError(str(exc)) from None

    def close(self, deadline_s: float | None = None) -> CloseReport | None:
        """End the AFD session: stop the executor, then tell the FFN ranks this rank left.

        The FFN ranks end their serving loop with that reason (a process that
        simply exits is noticed too: its connections close).
        """
        self._live.stop()
        if self._session is not None:
            self._failover_record = self.failovers()
            self._stamps_record = self.round_trip_stamps()
        session, self._session = self._session, None
        if session is None:
            return None
        if session.rejoiner is not None:
            session.rejoiner.close()
        report = session.executor.close(deadline_s)
        session.link.abort("the attention rank closed its AFD session")
        session.link.release()
        return report

    def failovers(self) -> dict[str, Any] | None:
        """The connector's failover record (FFN ranks lost, re-sends and when), None where it keeps none."""
        session = self._session
        if session is None:
            return self._failover_record  # what the last session did, once closed
        log = session.failover_log
        return None if log is None else log.as_dict()

    def round_trip_stamps(self) -> dict[str, Any] | None:
        """The torch_p2p round-trip side's mean stamps (:class:`~afd_mrv2.hooks.p2p.stamps.AttentionStamps`,
        docs/internals/p2p-transport.md), or None for another connector; once closed, the last session's."""
        session = self._session
        if session is None:
            return self._stamps_record
        connector = session.plugins.connector
        if isinstance(connector, TorchP2pConnector) and isinstance(connector.side, RoundTripAttentionSide):
            return connector.side.stamps.as_dict()
        return None

    def stats(self) -> dict[str, Any]:
        return {
            "moe_layers": self._order or sorted(self._layers),
            "calls": self.calls,
            "tokens_per_call": dict(sorted(self.tokens.items())),
            "items_by_stage_count": {str(n): c for n, c in sorted(self.items_by_stage_count.items())},
            "overlap": self.meter.snapshot(),
            "failover": self.failovers(),
            "round_trip_stamps": self.round_trip_stamps(),
        }


_PROCESS: RemoteExperts | None = None
_PROCESS_LOCK = threading.Lock()


def attach(
    config: AfdConfig, *, max_tokens: int, handoff: Handoff | None = None, share: RowShare | None = None
) -> RemoteExperts:
    """This process's :class:`RemoteExperts`, created by the first AFD layer."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = RemoteExperts(config, max_tokens=max_tokens, handoff=handoff, open_early=True, share=share)
        elif _PROCESS.config != config:
            raise ConfigError("afd", "one process serves one afd section; a second, different one was given")
        return _PROCESS


def attached() -> RemoteExperts | None:
    """This process's :class:`RemoteExperts`, or None when no AFD layer was built here."""
    return _PROCESS


def _require() -> RemoteExperts:
    if _PROCESS is None:
        raise RuntimeError(f"{OP_NAME} called in a process where no AFD MoE layer was constructed")
    return _PROCESS


@torch.library.custom_op(OP_NAME, mutates_args=())
def remote_routed_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_index: int
) -> torch.Tensor:
    """The routed experts' output for ``x`` from the FFN role (one AFD round trip)."""
    return _require().exchange(layer_index, x, topk_weights, topk_ids)


@remote_routed_experts.register_fake
def _remote_routed_experts_fake(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_index: int
) -> torch.Tensor:
    del topk_weights, topk_ids, layer_index
    return torch.empty_like(x)
