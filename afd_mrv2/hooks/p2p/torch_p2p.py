"""``torch_p2p``: the reference AFD connector on torch.distributed point-to-point.

Registered under the ``afd_mrv2`` entry-point group as ``torch_p2p``, exactly as
a third-party connector would be.  It posts ``ProcessGroup.send``/``recv`` and
waits for them through :class:`~afd_mrv2.hooks.p2p.link.PeerLink`, so the logic
is backend-neutral; today its buffers are host tensors, which is what gloo (CPUs,
this project's CI) needs.  NCCL/HCCL would need the slot buffers on the device
and the waits expressed as stream edges; that is not done (and not tested: it
needs two accelerators).

What moves, per work item ``(layer, stage, seq)`` (details in
:mod:`afd_mrv2.hooks.p2p.wire`)::

    attention rank a --dispatch--> FFN rank f   header + rows of the tokens routed
                                                to f's experts (hidden, top-k ids
                                                and weights)
    attention rank a <--combine--- FFN rank f   header + f's partial output rows

Topology and expert placement: :mod:`afd_mrv2.topology` (A x F ranks, experts
sharded in contiguous blocks, every attention rank talks to every FFN rank, the
shared expert runs where a token's top-1 expert lives).

Runtime objects (the role's context, :class:`~afd_mrv2.plugins.AttentionContext` /
:class:`~afd_mrv2.plugins.FfnContext`):
    ``p2p_link``: a :class:`~afd_mrv2.hooks.p2p.link.PeerLink`, one per process,
    built by the owner on its process group before any executor (it pre-posts the
    control channel, which must outlive every executor of the process).
    ``model``: a :class:`~afd_mrv2.hooks.p2p.common.P2pShape`.
    ``source`` / ``sink`` (Attention role, optional): an owner that hands each item
    over and waits for its result (the :class:`~afd_mrv2.mrv2.attention.exchange.UBatchExchange`
    contract, e.g. a vLLM MoE layer) provides both and gets the round-trip side
    (:mod:`afd_mrv2.hooks.p2p.roundtrip`); without them the attention side is
    layer-pipelined (:mod:`afd_mrv2.hooks.p2p.attention`).
    ``attention_peers`` (FFN role, optional): the global ranks of the attention
    ranks this executor serves (default: all of them).  An owner whose attention
    ranks are independent engines runs one executor per attention rank
    (:mod:`afd_mrv2.mrv2.ffn.server`), so that none waits for another's items.

    ``follow_stages`` (FFN role, optional, default false): take each item's layer
    and stage identity from the Attention side's headers instead of from the
    submitted item (checked against the order the Attention side issues them), so
    an owner that cannot know whether a step was split (independent engines
    deciding alone) accepts both stage counts; see ``FfnSide._follow``.
    ``on_item`` (FFN role, optional): called with each item's identity as received
    (with ``follow_stages``: layer and ``stage i of n`` from the header) once its
    headers were validated, zero-token items included (``serve_ffn`` counts items
    per stage count with it).

Capability: expert-replica failover (:class:`~afd_mrv2.api.SupportsFailover`).  The
round-trip Attention side routes around a lost FFN rank and takes it back
(:meth:`TorchP2pConnector.attention_failover`); the FFN side counts the re-sends it
served (:meth:`TorchP2pConnector.ffn_failover`).

Stage identity: every header carries the item's layer, ``stage i of n`` and seq,
checked on every message, so the connector declares ``carries_stage_identity``
(what afd-mrv2's micro-batching requires of a connector on the vLLM path).

Options: see :mod:`afd_mrv2.hooks.p2p.common` (``recv_timeout_s``,
``send_timeout_s``, ``sim_latency_us``, ``sim_bandwidth_gbps``, ``max_tokens``,
``quant``).

The owner's ``compute`` (the executor's ``compute=``):
    attention role, pipelined: ``compute(item, combined) -> (hidden, topk_ids, topk_weights) | None``
    (see :mod:`afd_mrv2.hooks.p2p.attention`);
    attention role, round trip: ``compute(item, (hidden, topk_ids, topk_weights)) -> the same triple``
    (see :mod:`afd_mrv2.hooks.p2p.roundtrip`);
    FFN role: ``compute(item, hidden, topk_ids, topk_weights) -> partial_output``;
    with ``quant: w8a8``: ``compute(item, hidden_int8, topk_ids, topk_weights, scales)``
    (see :mod:`afd_mrv2.hooks.p2p.ffn`).

Contract between the roles: both number work items identically (the same
``(layer, stage, seq)`` for the same data on every rank) and submit them in the
same order; the headers check it on every message.

Failures (all end in bounded time, all name the peer): a dead peer ->
:class:`~afd_mrv2.hooks.p2p.errors.PeerLost` at once; a silent peer ->
:class:`~afd_mrv2.hooks.p2p.errors.PeerTimeout` at the deadline; a bad header ->
:class:`~afd_mrv2.hooks.p2p.errors.ProtocolError` naming the field; a peer that
failed on its own -> :class:`~afd_mrv2.hooks.p2p.errors.PeerAborted` with its
reason.  After any of them the process group's message order is lost: the owner
must tear it down (:meth:`PeerLink.abort`, then exit or rebuild).
"""

from __future__ import annotations

from typing import ClassVar

from afd_mrv2.api import AttentionFailover, FfnFailover, SupportsFailover
from afd_mrv2.errors import PluginError
from afd_mrv2.hooks.p2p.attention import AttentionSide
from afd_mrv2.hooks.p2p.common import P2pShape, parse_options
from afd_mrv2.hooks.p2p.ffn import FfnSide
from afd_mrv2.hooks.p2p.link import PeerLink
from afd_mrv2.hooks.p2p.roundtrip import RoundTripAttentionSide
from afd_mrv2.hookspecs import ComputeFn, hookimpl
from afd_mrv2.plugins import ConnectorContext, FfnContext
from afd_mrv2.work import Work


class TorchP2pConnector(SupportsFailover):
    """The torch_p2p connector; see the module docstring."""

    required_capability: ClassVar[str | None] = None  # torch.distributed only: any runtime pair
    hook_api_version: ClassVar[int] = 2
    carries_stage_identity: ClassVar[bool] = True  # every header names the layer and stage i of n

    def __init__(self, context: ConnectorContext) -> None:
        context = context.typed()
        link = context.need(context.p2p_link, "p2p_link")
        shape = context.need(context.model, "model")
        if not isinstance(link, PeerLink):
            raise PluginError(f"torch_p2p: resource 'p2p_link' must be a PeerLink, got {type(link).__name__}")
        if not isinstance(shape, P2pShape):
            raise PluginError(f"torch_p2p: resource 'model' must be a P2pShape, got {type(shape).__name__}")
        if context.role != link.role:
            raise PluginError(
                f"torch_p2p: afd.role is {context.role!r} but global rank {link.rank} is "
                f"{link.topology.describe(link.rank)}"
            )
        options = parse_options(context.config.extra)
        self.side: AttentionSide | FfnSide
        if isinstance(context, FfnContext):
            self.side = FfnSide(
                link,
                shape,
                options,
                peers=context.attention_peers,
                follow_stages=context.follow_stages,
                on_item=context.on_item,
            )
        elif context.sink is not None:  # an exchange owner: each item is one round trip
            source = context.need(context.source, "source")
            self.side = RoundTripAttentionSide(link, shape, options, source=source, sink=context.sink)
        else:  # the owner drives the layer loop: layer l-1's combine arrives in item l's recv
            self.side = AttentionSide(link, shape, options)

    def attention_failover(self) -> AttentionFailover | None:
        """The round-trip Attention side (it fails over); None on the FFN role and the layer-pipelined side."""
        return self.side if isinstance(self.side, RoundTripAttentionSide) else None

    def ffn_failover(self) -> FfnFailover | None:
        """The FFN side (it counts the re-sends it served); None on the Attention role."""
        return self.side if isinstance(self.side, FfnSide) else None

    @hookimpl
    def on_recv(self, work: Work) -> None:
        self.side.on_recv(work)

    @hookimpl
    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        self.side.on_compute(work, compute)

    @hookimpl
    def on_send(self, work: Work) -> None:
        self.side.on_send(work)

    @hookimpl
    def on_cleanup(self, work: Work, error: BaseException) -> None:
        del error
        self.side.on_cleanup(work)
