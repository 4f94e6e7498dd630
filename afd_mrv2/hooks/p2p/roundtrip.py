"""The round-trip attention side of torch_p2p: one complete exchange per work item.

:class:`RoundTripAttentionSide`, :class:`CombineInFlight`, :class:`Share`; the side that fails over.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.roundtrip".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_mrv2.api import supports_in_flight
from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.attention import _CPU, AttentionSide, Routed, _Dispatch, _tensor_triple
from afd_mrv2.hooks.p2p.buffers import CombineBuffer, DispatchBuffer, HeaderSlot
from afd_mrv2.hooks.p2p.common import P2pOptions, P2pShape, charge_link
from afd_mrv2.hooks.p2p.errors import PeerAborted, PeerError, PeerLost, PeerTimeout
from afd_mrv2.hooks.p2p.failover import FailoverLog
from afd_mrv2.hooks.p2p.link import PeerLink, Pending
from afd_mrv2.hooks.p2p.stamps import AttentionStamps
from afd_mrv2.hookspecs import ComputeFn
from afd_mrv2.items import WorkItem
from afd_mrv2.placement import NoLiveHolder
from afd_mrv2.work import Work

RoutedSource = Callable[[WorkItem], Any]
Sink = Callable[[WorkItem, Any], None]


@dataclass(eq=False, slots=True)
class Share:
    """One FFN rank's part of an item on the wire: the message posted to it and the combine due back.

    ``index``: the item's token rows sent; ``mask`` [count, k]: which of their pairs it computes;
    ``seq``: the message's number on the pair; ``failed``: the loss seen while posting or sending;
    ``sent_ns``: when its first isend was posted (``time.perf_counter_ns``).
    """

    ffn: int  # FFN rank index
    seq: int
    index: torch.Tensor
    mask: torch.Tensor
    buffer: CombineBuffer  # where the combine lands
    receive: Pending | None = None
    sends: list[Pending] = field(default_factory=list)
    failed: PeerError | None = None
    sent_ns: int = 0

    @property
    def count(self) -> int:
        return self.index.numel()


_ZERO = torch.zeros(())

#: what ends a pair: its FFN rank died, aborted, or stalled past the deadline (a bad header is not one)
LOSSES = (PeerLost, PeerAborted, PeerTimeout)


@dataclass(eq=False, slots=True)
class CombineInFlight:
    """The combine of one item, posted by ``on_send``: what the owner waits for with :meth:`wait`.

    ``delivered_ns``: when the last partial arrived (``time.perf_counter_ns``), set by ``wait``.
    ``sent_ns`` / ``sends_done_ns``: when the dispatch's first isend was posted and when its sends were done.
    """

    side: RoundTripAttentionSide
    item: WorkItem
    dispatch: _Dispatch
    inbox: list[CombineBuffer]
    shares: list[Share]
    delivered_ns: int = 0
    sent_ns: int = 0
    sends_done_ns: int = 0
    _result: torch.Tensor | None = field(default=None, repr=False)

    def wait(self) -> torch.Tensor:
        """Wait for every FFN rank's partial (under ``recv_timeout_s``), check each header, sum them.

        A share whose FFN rank is lost meanwhile is re-sent to live holders of its experts
        (:meth:`RoundTripAttentionSide.fail_over`) and their partials are summed in its place.  An item
        that came back with no loss adds its stamps to the side's :class:`AttentionStamps`.
        """
        if self._result is not None:
            return self._result
        side, item, dispatch = self.side, self.item, self.dispatch
        arrived = time.perf_counter()
        nbytes, last_done, waited, whole = 0, 0.0, 0, True
        action, received = f"receiving the combine of {item}", []
        # what can be made before a partial arrives is: the result, each share's expected header
        combined = torch.zeros(dispatch.tokens, side.shape.hidden_size)
        todo = deque(self.shares)
        while todo:
            share = todo.popleft()
            expected = wire.item_words(
                wire.KIND_COMBINE, side.peers[share.ffn], side.link.rank, item, share.count, share.seq
            )
            try:
                if share.failed is not None:
                    raise share.failed
                assert share.receive is not None
                timeout = side.options.recv_timeout_s
                side.link.wait([share.receive], timeout_s=timeout, work=None, action=action, option="recv_timeout_s")
            except LOSSES as exc:
                whole = False
                self._retire(share)
                todo.extend(side.fail_over(item, dispatch, share, exc))
                continue
            waited, last_done = time.perf_counter_ns(), max(last_done, share.receive.done_at)
            arrived, nbytes = max(arrived, share.receive.done_at), nbytes + share.receive.nbytes
            wire.check_words(share.buffer.header.words(), expected, what="combine", describe=side.link.describe)
            received.append(share)
        _sum(received, combined)
        link = side.options.link
        if link is not None:  # the simulated link delivers the bytes later than gloo did
            arrived += link.cost_s("recv", nbytes)
            time.sleep(max(0.0, arrived - time.perf_counter()))
        self.delivered_ns = int(arrived * 1e9)
        side.give_back(self.inbox)
        self._result = combined
        if whole:
            self._stamp(int(last_done * 1e9), waited)
        return combined

    def _stamp(self, combine_done: int, waited: int) -> None:
        """Add this item's points to the side's stamps: ``waited`` (the last ``link.wait`` returned) and
        the combine's ``done_at`` (``combine_done``, the last share's) as measured, unpacked: now."""
        dispatch = self.dispatch
        self.side.stamps.add(
            dispatch.entered_ns,
            dispatch.packed_ns,
            self.sent_ns,
            self.sends_done_ns,
            combine_done,
            waited,
            time.perf_counter_ns(),
        )

    def _retire(self, share: Share) -> None:
        """A lost pair may still write into its combine buffer (a stalled peer): never reuse it."""
        for position, buffer in enumerate(self.inbox):
            if buffer is share.buffer:
                self.inbox[position] = CombineBuffer(torch.empty_like(buffer.tensor), buffer.hidden_size)


def _sum(shares: list[Share], combined: torch.Tensor) -> None:
    """Add the shares' partials into ``combined`` (zeros [T, H]), each at its rows (``index``), in order.

    One share of every row (its index then is 0..T-1: an index is ascending and unique) is written as
    ``rows + 0``, one operation that gives what adding it onto zeros gives, bit for bit (-0.0 included).
    """
    if len(shares) == 1 and shares[0].count == combined.shape[0]:
        torch.add(shares[0].buffer.at(shares[0].count).rows, _ZERO, out=combined)  # a Python 0.0 costs 2x
        return
    for share in shares:
        if share.count:
            combined.index_add_(0, share.index, share.buffer.at(share.count).rows)


class RoundTripAttentionSide(AttentionSide):
    """Phase logic of an attention rank whose caller waits for each item; see docs/internals/p2p-transport.md."""

    def __init__(
        self, link: PeerLink, shape: P2pShape, options: P2pOptions, *, source: RoutedSource, sink: Sink
    ) -> None:
        super().__init__(link, shape, options)
        self.source = source
        self.sink = sink
        # a sink that did not opt in keeps the tensor contract (a wrapper reads ``result.shape``)
        self.sink_accepts_in_flight = supports_in_flight(sink)
        self._free_inboxes: list[list[CombineBuffer]] = []
        self._inbox_lock = threading.Lock()
        self._pair_seq = [0] * len(self.peers)  # the next message's number on each pair
        self._pair_locks = [threading.Lock() for _ in self.peers]
        self._failover_lock = threading.Lock()
        self.failovers = FailoverLog()
        #: where this side's round trips go (docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.stamps")
        self.stamps = AttentionStamps()

    def _take_inbox(self) -> list[CombineBuffer]:
        """Per FFN rank, uint8 [header + max_tokens * H * 4]: where one item's combines land."""
        with self._inbox_lock:
            if self._free_inboxes:
                return self._free_inboxes.pop()
        return [CombineBuffer.empty(self.shape.hidden_size, self.capacity) for _ in self.peers]

    def give_back(self, inbox: list[CombineBuffer]) -> None:
        """An inbox whose combines were read (by :meth:`CombineInFlight.wait`) may take another item's."""
        with self._inbox_lock:
            self._free_inboxes.append(inbox)

    def on_recv(self, work: Work) -> None:
        routed = self._check_result(work.item, _on_host(self.source(work.item)))
        work.transfer["routed"], work.transfer["versions"] = routed, _versions(routed)

    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        entered = time.perf_counter_ns()
        checked = work.transfer.pop("routed")
        routed = compute(work.item, checked)
        # checked in on_recv: again unless compute returned those tensors, provably unchanged
        versions = work.transfer.pop("versions")
        if routed is not checked or versions is None or _versions(checked) != versions:
            routed = self._check_result(work.item, routed)
        dispatch = self._pack(work, self._outputs(work), *routed)
        dispatch.entered_ns, dispatch.packed_ns = entered, time.perf_counter_ns()

    def on_send(self, work: Work) -> None:
        item, dispatch, slot = work.item, work.transfer["dispatch"], self._outputs(work)
        inbox = self._take_inbox()
        live, kind, name = self.live, self.layout.kind, str(item)
        what = "combine message (" + name + ")"
        shares = [
            self._post(item, f, kind, slot.headers[f], slot.staging[f], index, dispatch.masks[f], inbox[f], what)
            for f, index in enumerate(dispatch.indices)
            if f in live or dispatch.counts[f]
        ]
        self._await_sends(shares, work, "dispatching " + name)
        sends_done = time.perf_counter_ns()
        if self.options.link is not None:
            charge_link(self.options, work, "send", [p for share in shares for p in share.sends])
        sent = shares[0].sent_ns if shares else 0
        in_flight = CombineInFlight(self, item, dispatch, inbox, shares, sent_ns=sent, sends_done_ns=sends_done)
        self.sink(item, in_flight if self.sink_accepts_in_flight else in_flight.wait())

    def _post(
        self,
        item: WorkItem,
        f: int,
        kind: int,
        header: HeaderSlot,
        payload: DispatchBuffer,
        index: torch.Tensor,
        mask: torch.Tensor,
        buffer: CombineBuffer,
        what: str,
    ) -> Share:
        """Post FFN rank ``f``'s combine receive (``what`` names it), then send it its header and payload, as the
        next message of the pair (one lock per pair: the pair's messages go out in ``seq`` order, gloo matches in
        posting order)."""
        peer, count, link = self.peers[f], index.numel(), self.link
        with self._pair_locks[f]:
            seq = self._pair_seq[f]
            self._pair_seq[f] += 1
            share = Share(f, seq, index, mask, buffer)
            header.write(wire.item_words(kind, link.rank, peer, item, count, seq))
            try:
                share.receive = link.irecv(buffer.at(count).message, peer, wire.TAG_COMBINE, what)
                share.sent_ns = time.perf_counter_ns()
                share.sends.append(link.isend(header.tensor, peer, wire.TAG_DISPATCH_HEADER, "dispatch header"))
                if count:
                    message = payload.at(count).message
                    share.sends.append(link.isend(message, peer, wire.TAG_DISPATCH_PAYLOAD, "dispatch payload"))
            except LOSSES as exc:  # the pair is already closed
                share.failed = exc
        return share

    def _await_sends(self, shares: list[Share], work: Work | None, action: str) -> None:
        """Wait until every share's FFN rank took its messages; with replicas a lost rank only marks its share."""
        for share in shares:
            if share.failed is not None:
                continue
            try:
                self.link.wait(
                    share.sends,
                    timeout_s=self.options.send_timeout_s,
                    work=work,
                    action=action,
                    option="send_timeout_s",
                )
            except LOSSES as exc:
                if self.placement.replicas == 1 or not self.link.scoped:
                    raise
                share.failed = exc

    def fail_over(self, item: WorkItem, dispatch: _Dispatch, share: Share, loss: PeerError) -> list[Share]:
        """``share``'s FFN rank is lost: stop routing to it and re-send its part of ``item`` to the live
        holders of its experts (kind ``redispatch``); returns the new shares.  Without replicas, on a link
        whose faults are not scoped to a peer (a wait there names any lost peer, not only its own), or when
        some expert has no live holder left, the loss is raised as it came."""
        if self.placement.replicas == 1 or not self.link.scoped or loss.peer != self.peers[share.ffn]:
            raise loss
        with self._failover_lock:
            if share.ffn in self.live:
                live = self.live - {share.ffn}
                try:
                    route = torch.tensor(self.placement.routing(live), dtype=torch.long)
                except NoLiveHolder as exc:
                    raise loss from exc
                moved = [e for e, f in enumerate(self.route.tolist()) if f == share.ffn]
                self.live, self.route = live, route
                self.failovers.lost(share.ffn, loss, moved, live, self.link.me)
        assert dispatch.routed is not None
        topk_ids = dispatch.routed[2]
        owners = self.route[topk_ids.index_select(0, share.index).long()]
        shares, what = [], f"combine message ({item})"
        for g in sorted(self.live):
            pairs = share.mask & (owners == g)
            rows = pairs.any(dim=1).nonzero().squeeze(1)
            if not rows.numel():
                continue
            index, mask = share.index.index_select(0, rows), pairs.index_select(0, rows)
            payload = DispatchBuffer(torch.empty(self.layout.nbytes(index.numel()), dtype=torch.uint8), self.layout)
            self.pack_rows(payload.at(index.numel()), index, mask, dispatch.routed)
            header = HeaderSlot(torch.empty(wire.HEADER_WORDS, dtype=torch.int64))
            buffer = CombineBuffer.empty(self.shape.hidden_size, index.numel())
            kind = self.layout.redispatch_kind
            shares.append(self._post(item, g, kind, header, payload, index, mask, buffer, what))
        self._await_sends(shares, None, f"re-sending FFN rank {share.ffn}'s share of {item}")
        self.failovers.resent(share.ffn, sum(s.count for s in shares))
        return shares

    def start_without(self, ffn: int) -> None:
        """FFN rank ``ffn`` was already lost when this side started (its link has no pair with it): route its
        experts to their other holders from the first item; :class:`NoLiveHolder` when some has none."""
        with self._failover_lock:
            live = self.live - {ffn}
            self.route = torch.tensor(self.placement.routing(live), dtype=torch.long)
            self.live = live

    def take_back(self, ffn: int) -> None:
        """FFN rank ``ffn`` is back (a restarted process on a new pair, installed in the link by the owner
        between two steps, with no item in flight): route its experts to it again, numbering from 0."""
        with self._failover_lock:
            live = self.live | {ffn}
            self.route = torch.tensor(self.placement.routing(live), dtype=torch.long)
            self.live = live
            with self._pair_locks[ffn]:
                self._pair_seq[ffn] = 0
        self.failovers.rejoined(ffn, self.link.pair_name(self.peers[ffn]), self.link.me)

    def on_cleanup(self, work: Work) -> None:
        work.transfer.pop("routed", None)
        work.transfer.pop("versions", None)
        super().on_cleanup(work)


def _on_host(routed: Any) -> Any:
    """(hidden, topk_ids, topk_weights) as the wire carries them: host tensors, hidden and weights fp32.

    The caller's tensors may live on an accelerator or be bf16/fp16; anything else
    is passed through for ``_check_result`` to describe.
    """
    triple = _tensor_triple(routed)
    if triple is None:
        return routed
    return _host_fp32(triple[0]), triple[1] if triple[1].is_cpu else triple[1].to(_CPU), _host_fp32(triple[2])


def _host_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.to("cpu", torch.float32)``; a host fp32 tensor as it is, without the torch call."""
    return tensor if tensor.is_cpu and tensor.dtype == torch.float32 else tensor.to(_CPU, torch.float32)


def _versions(routed: Routed) -> tuple[int, int, int] | None:
    """The tensors' version counters, each grown by every in-place change (values, shape, storage); None when one
    is an inference tensor (``torch.inference_mode``, as vLLM's are: they keep no version counter)."""
    hidden, ids, weights = routed
    if hidden.is_inference() or ids.is_inference() or weights.is_inference():
        return None
    return hidden._version, ids._version, weights._version
