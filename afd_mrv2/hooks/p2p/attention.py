"""The attention side of torch_p2p (layer-pipelined): :class:`AttentionSide`.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.attention".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.buffers import CombineBuffer, DispatchBuffer, DispatchViews, HeaderSlot, Prefixes, id_range
from afd_mrv2.hooks.p2p.common import P2pOptions, P2pShape, Side, charge_link
from afd_mrv2.hooks.p2p.link import PeerLink, Pending
from afd_mrv2.hooks.quant import quantize_per_token
from afd_mrv2.hookspecs import ComputeFn
from afd_mrv2.items import WorkItem
from afd_mrv2.work import Work

_SLICE_S = 0.05
_CPU = torch.device("cpu")

#: what the owner's compute returns and the dispatch carries: (hidden [T, H], topk_ids [T, k], topk_weights [T, k])
Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: a dispatch's rows as packed: (hidden as sent, its scales or None, topk_ids, topk_weights)
Packed = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


@dataclass
class _Outputs:
    """An output slot: what compute packs and send reads."""

    headers: list[HeaderSlot]  # per FFN rank, its dispatch header
    staging: list[DispatchBuffer]  # per FFN rank, uint8 [max_tokens * row_bytes]


@dataclass
class _Dispatch:
    """Per-item transfer state (``work.transfer["dispatch"]``), from compute to send.

    Per FFN rank (peer order): the rows sent (``counts``, ``indices`` into the item's
    tokens) and which of their top-k pairs are routed there (``masks`` [count, k]).
    ``routed``: the item's (hidden as sent, scales or None, topk_ids, topk_weights),
    kept for a failover's re-send.  ``entered_ns`` / ``packed_ns``: the round-trip side's stamps
    (``time.perf_counter_ns``) of ``on_compute``'s entry and of the end of the packing.
    """

    tokens: int
    counts: list[int]
    indices: list[torch.Tensor]
    masks: list[torch.Tensor] = field(default_factory=list)
    routed: Packed | None = None
    entered_ns: int = 0
    packed_ns: int = 0


@dataclass
class _Inbox:
    """Where the combine of one stage lands, from on_send(l, s) until on_compute(l+1, s)."""

    buffers: list[CombineBuffer]  # per FFN rank, uint8 [header + max_tokens * H * 4]
    cond: threading.Condition = field(default_factory=threading.Condition)
    sent: WorkItem | None = None  # the item whose combine is posted here
    tokens: int = 0
    counts: list[int] = field(default_factory=list)
    indices: list[torch.Tensor] = field(default_factory=list)
    pendings: list[Pending] = field(default_factory=list)


class AttentionSide(Side):
    """Phase logic of an attention rank; see docs/internals/p2p-transport.md."""

    def __init__(self, link: PeerLink, shape: P2pShape, options: P2pOptions) -> None:
        super().__init__(link, shape, options)
        self.placement = link.topology.placement
        #: the FFN ranks (indices) this side routes to, and ``route[e]``: the one computing expert ``e``
        self.live: frozenset[int] = frozenset(range(self.placement.num_ffn))
        self.route = torch.tensor(self.placement.routing(self.live), dtype=torch.long)
        # the sole FFN rank's index and mask: every row, every pair (see _pack); another's: none
        self._every_row = Prefixes(torch.arange(self.capacity))
        self._every_pair = Prefixes(torch.ones(self.capacity, shape.top_k, dtype=torch.bool))
        self._no_row = (self._every_row.at(0), self._every_pair.at(0))
        self._inboxes: dict[int, _Inbox] = {}
        self._inbox_lock = threading.Lock()

    @property
    def route(self) -> torch.Tensor:
        """``route[e]``: the FFN rank (index) computing expert ``e`` now."""
        return self._route

    @route.setter
    def route(self, route: torch.Tensor) -> None:
        self._route = route
        ranks = set(route.tolist())
        #: the FFN rank computing every expert (one FFN rank, or all but one lost), else None
        self._sole: int | None = ranks.pop() if len(ranks) == 1 else None

    # ------------------------------------------------------------------ buffers

    def _combined(self, work: Work) -> torch.Tensor:
        """The input slot: [max_tokens, H], where compute sums the FFN partials it reads."""
        if work.inputs.state is None:
            work.inputs.state = torch.empty(self.capacity, self.shape.hidden_size)
        combined: torch.Tensor = work.inputs.state
        return combined

    def _outputs(self, work: Work) -> _Outputs:
        if work.outputs.state is None:
            headers = torch.zeros(len(self.peers), wire.HEADER_WORDS, dtype=torch.int64)
            work.outputs.state = _Outputs(
                headers=[HeaderSlot(words) for words in headers],
                staging=[
                    DispatchBuffer(torch.empty(self.layout.nbytes(self.capacity), dtype=torch.uint8), self.layout)
                    for _ in self.peers
                ],
            )
        outputs: _Outputs = work.outputs.state
        return outputs

    def _inbox(self, stage: int) -> _Inbox:
        with self._inbox_lock:
            inbox = self._inboxes.get(stage)
            if inbox is None:
                buffers = [CombineBuffer.empty(self.shape.hidden_size, self.capacity) for _ in self.peers]
                inbox = self._inboxes[stage] = _Inbox(buffers)
            return inbox

    # ------------------------------------------------------------------ phases

    def on_recv(self, work: Work) -> None:
        item = work.item
        if item.layer_idx == 0:
            return
        sent = self._await_posted(work, item.layer_idx - 1)
        inbox = self._inbox(item.stage_idx)
        action = f"receiving the combine of layer={sent.layer_idx} stage={sent.stage_idx} seq={sent.seq}"
        self.wait(inbox.pendings, work, "recv", action)
        for ffn, buffer, count in zip(self.peers, inbox.buffers, inbox.counts, strict=True):
            expected = wire.item_words(wire.KIND_COMBINE, ffn, self.link.rank, sent, count)
            wire.check_words(buffer.header.words(), expected, what="combine", describe=self.link.describe)
        charge_link(self.options, work, "recv", inbox.pendings)

    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        item = work.item
        combined = None
        if item.layer_idx > 0:
            inbox = self._inboxes[item.stage_idx]
            combined = self._combined(work)[: inbox.tokens].zero_()
            for buffer, count, index in zip(inbox.buffers, inbox.counts, inbox.indices, strict=True):
                if count:
                    combined.index_add_(0, index, buffer.at(count).rows)
        result = compute(item, combined)
        if result is None:
            return
        slot = self._outputs(work)
        dispatch = self._pack(work, slot, *self._check_result(item, result))
        for f, ffn in enumerate(self.peers):
            slot.headers[f].write(wire.item_words(self.layout.kind, self.link.rank, ffn, item, dispatch.counts[f]))

    def _pack(
        self, work: Work, slot: _Outputs, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> _Dispatch:
        """Pack, per FFN rank, the rows routed to it into ``slot``'s staging; record the dispatch (in
        ``work.transfer`` and returned).  The headers are the caller's to write."""
        wire.check_stage(work.item)  # an item that cannot go on the wire fails before any of it is packed
        tokens, sole = hidden.shape[0], self._sole
        scales = None
        if self.layout.quant is not None:  # per token, once for all FFN ranks, before anything is sent
            hidden, scales = quantize_per_token(hidden)
        routed = (hidden, scales, topk_ids, topk_weights)
        if sole is None:
            owners = self.route[topk_ids.long()]
            picks = [self._pick(owners == f, slot.staging[f], routed) for f in range(len(self.peers))]
        else:  # every pair is the sole rank's: the rows as they are, no selection, no mask
            self._pack_all(slot.staging[sole].at(tokens), routed)
            every = (self._every_row.at(tokens), self._every_pair.at(tokens))
            picks = [every if f == sole else self._no_row for f in range(len(self.peers))]
        indices = [index for index, _ in picks]
        counts = [index.numel() for index in indices]
        dispatch = _Dispatch(tokens, counts, indices, [mask for _, mask in picks], routed)
        work.transfer["dispatch"] = dispatch
        return dispatch

    def _pick(
        self, assigned: torch.Tensor, staging: DispatchBuffer, routed: Packed
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pack the rows with a pair in ``assigned`` [T, k] (the pairs one FFN rank computes); their index and mask."""
        index = assigned.any(dim=1).nonzero().squeeze(1)
        mask = assigned.index_select(0, index)
        self.pack_rows(staging.at(index.numel()), index, mask, routed)
        return index, mask

    @staticmethod
    def pack_rows(views: DispatchViews, index: torch.Tensor, mask: torch.Tensor, routed: Packed) -> None:
        """Write the dispatch payload of the token rows ``index`` into ``views`` (of ``index.numel()`` rows): their
        hidden rows (and scales), ids, and weights, a pair outside ``mask`` (routed to another rank) weighing 0."""
        hidden, scales, topk_ids, topk_weights = routed
        torch.index_select(hidden, 0, index, out=views.hidden)
        if scales is not None:
            assert views.scales is not None  # a quantized dispatch packs into a quantized layout
            torch.index_select(scales, 0, index, out=views.scales)
        torch.index_select(topk_weights, 0, index, out=views.weights)
        views.weights.mul_(mask)
        views.ids.copy_(topk_ids.index_select(0, index))

    @staticmethod
    def _pack_all(views: DispatchViews, routed: Packed) -> None:
        """:meth:`pack_rows` of every row with every pair kept: three copies."""
        hidden, scales, topk_ids, topk_weights = routed
        views.hidden.copy_(hidden)
        if scales is not None:
            assert views.scales is not None  # a quantized dispatch packs into a quantized layout
            views.scales.copy_(scales)
        views.weights.copy_(topk_weights)
        views.ids.copy_(topk_ids)

    def on_send(self, work: Work) -> None:
        item, dispatch = work.item, work.transfer.get("dispatch")
        if dispatch is None:  # the epilogue item: nothing to dispatch
            return
        slot = self._outputs(work)
        inbox = self._inbox(item.stage_idx)
        what = f"combine message ({item.stage_id})"
        with inbox.cond:
            inbox.pendings = [
                self.link.irecv(buffer.at(count).message, ffn, wire.TAG_COMBINE, what)
                for ffn, buffer, count in zip(self.peers, inbox.buffers, dispatch.counts, strict=True)
            ]
            inbox.sent, inbox.tokens = item, dispatch.tokens
            inbox.counts, inbox.indices = dispatch.counts, dispatch.indices
            inbox.cond.notify_all()
        self._dispatch(work, slot, dispatch.counts)

    def _dispatch(self, work: Work, slot: _Outputs, counts: list[int]) -> None:
        """Send each FFN rank its header and, for n > 0 rows, its payload; wait for the sends."""
        sends = []
        for f, ffn in enumerate(self.peers):
            sends.append(self.link.isend(slot.headers[f].tensor, ffn, wire.TAG_DISPATCH_HEADER, "dispatch header"))
            if counts[f]:
                payload = slot.staging[f].at(counts[f]).message
                sends.append(self.link.isend(payload, ffn, wire.TAG_DISPATCH_PAYLOAD, "dispatch payload"))
        self.wait(sends, work, "send", f"dispatching {work.item}")
        charge_link(self.options, work, "send", sends)

    def on_cleanup(self, work: Work) -> None:
        # gloo operations cannot be cancelled; their Pending objects keep the buffers
        # alive until the watcher sees them end.  Drop this item's routing state.
        work.transfer.pop("dispatch", None)

    # ------------------------------------------------------------------ helpers

    def _await_posted(self, work: Work, layer: int) -> WorkItem:
        """Wait until on_send of (layer, stage) posted the combine receives of this stage; returns that item.

        Usually already true; with a depth larger than the number of stages the
        recv stream can get here before the send stream did.
        """
        inbox = self._inbox(work.item.stage_idx)
        deadline = time.monotonic() + self.options.recv_timeout_s
        with inbox.cond:
            while inbox.sent is None or inbox.sent.layer_idx != layer:
                work.raise_if_cancelled()
                self.link.check_peers(self.peers)
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.link.me}: the dispatch of layer={layer} stage={work.item.stage_idx} was never sent, "
                        f"so its combine cannot arrive (waited {self.options.recv_timeout_s:g} s, recv_timeout_s); "
                        "are work items submitted in (batch, layer, stage) order?"
                    )
                inbox.cond.wait(_SLICE_S)
            return inbox.sent

    def _check_result(self, item: object, result: object) -> Routed:
        """The owner's compute must return (hidden [T, H] fp32, ids [T, k], weights [T, k])."""
        shape = self.shape
        triple = _tensor_triple(result)
        if triple is None or not self._result_fits(*triple):
            raise TypeError(
                f"attention compute for {item} must return None or (hidden [T, {shape.hidden_size}] float32, "
                f"topk_ids [T, {shape.top_k}] integer, topk_weights [T, {shape.top_k}] float32) with "
                f"T <= {self.capacity} (max_tokens) and ids in 0..{shape.num_experts - 1}; got {_describe(result)}"
            )
        hidden, ids, weights = triple
        return hidden.contiguous(), ids, weights.contiguous()

    def _result_fits(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> bool:
        shape = self.shape
        tokens = hidden.shape[0] if hidden.dim() == 2 else -1
        return (
            hidden.shape == (tokens, shape.hidden_size)
            and hidden.dtype == torch.float32
            and ids.shape == weights.shape == (tokens, shape.top_k)
            and weights.dtype == torch.float32
            and not ids.is_floating_point()
            and 0 <= tokens <= self.capacity
            and (ids.numel() == 0 or _within(ids, shape.num_experts))
        )


def _within(ids: torch.Tensor, num_experts: int) -> bool:
    """Every id in 0..num_experts-1 (``ids`` not empty)."""
    low, high = id_range(ids)
    return low >= 0 and high < num_experts


def _tensor_triple(value: object) -> Routed | None:
    """``value`` when it is a tuple of three tensors, else None."""
    if isinstance(value, tuple) and len(value) == 3:
        a, b, c = value
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(c, torch.Tensor):
            return a, b, c
    return None


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {value.dtype}"
    return type(value).__name__
