"""The round-trip attention side of torch_p2p: one complete exchange per work item.

The layer-pipelined side (:mod:`afd_mrv2.hooks.p2p.attention`) receives the
combine of layer ``l-1`` in item ``l``'s recv: right for a run that owns the
whole layer loop.  A vLLM MoE layer cannot wait that long: its routed-experts call
must return the combined output before the layer continues.  This side serves
that caller, item by item::

    on_recv     read (hidden [T, H], topk_ids [T, k], topk_weights [T, k]) from the
                ``source`` resource, as host tensors (hidden and weights in fp32, the
                wire format), and check them
    on_compute  ``compute(item, routed)`` -> the (possibly transformed) routed batch
                (identity for vLLM: the router already ran); pack, for every FFN
                rank, the rows routed to at least one of its experts
    on_send     post this item's combine receives, send the dispatch to every FFN
                rank and wait until the FFN ranks took it, then hand the ``sink``
                resource the combine in flight (:class:`CombineInFlight`): the
                owner's ``wait()`` on it (from ``UBatchExchange.finish``, on the
                model's thread) waits for every combine, checks each header, sums
                the partials in token order and returns the [T, H] result.  Only a
                sink that says it takes results in flight (attribute
                ``accepts_in_flight = True``, as ``UBatchExchange``'s does) gets one;
                any other sink (a plain function, or a third party's wrapper around
                the owner's sink) gets the [T, H] tensor, waited for in ``on_send``
                (the tensor contract third-party sink wrappers were written against)

The FFN side is unchanged (:mod:`afd_mrv2.hooks.p2p.ffn`): it sees the same
messages as from the pipelined side, item ``(layer, stage, seq)`` by item.
The combine receive is posted before the dispatch is sent, so the FFN rank's
combine send (a gloo rendezvous) never waits on this side.

Why the combine is not waited for in ``on_send``: the executor's send stream is
FIFO, so an ``on_send`` that waited for its combine would hold the next item's
dispatch until this item's whole round trip was over.  Two micro-batches of a
split step each have an item in flight (micro-batch B dispatches while A's round
trip flies); waiting in ``on_send`` would serialize their round trips on the
stream.  Posting stays in ``on_send``, in item order (gloo matches a channel's
receives and sends in posting order), and each item's combine lands in an inbox
of its own (taken from a free list, given back once ``wait()`` read it), not in
its output slot, which the executor reuses once ``on_send`` returned.

Selected by the owner's resources: an attention owner that provides ``source``
and ``sink`` (the contract of :class:`~afd_mrv2.mrv2.exchange.UBatchExchange`)
gets this side; one that provides neither drives the pipelined side.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.attention import AttentionSide, _Dispatch
from afd_mrv2.hooks.p2p.common import P2pOptions, P2pShape
from afd_mrv2.hooks.p2p.link import PeerLink, Pending
from afd_mrv2.hookspecs import ComputeFn
from afd_mrv2.items import WorkItem
from afd_mrv2.work import Work

RoutedSource = Callable[[WorkItem], Any]
Sink = Callable[[WorkItem, Any], None]
#: the attribute a ``sink`` sets to True to receive :class:`CombineInFlight` results instead of tensors
ACCEPTS_IN_FLIGHT = "accepts_in_flight"


@dataclass(eq=False)
class CombineInFlight:
    """The combine of one item, posted by ``on_send``: what the owner waits for with :meth:`wait`.

    ``delivered_ns``: when the last partial arrived (``time.perf_counter_ns``), set by ``wait``.
    """

    side: RoundTripAttentionSide
    item: WorkItem
    dispatch: _Dispatch
    inbox: list[torch.Tensor]
    receives: list[Pending]
    delivered_ns: int = 0
    _result: torch.Tensor | None = field(default=None, repr=False)

    def wait(self) -> torch.Tensor:
        """Wait for every FFN rank's partial (under ``recv_timeout_s``), check each header, sum them."""
        if self._result is not None:
            return self._result
        side, item, dispatch = self.side, self.item, self.dispatch
        side.link.wait(
            self.receives,
            timeout_s=side.options.recv_timeout_s,
            work=None,
            action=f"receiving the combine of {item}",
            option="recv_timeout_s",
        )
        arrived = max(p.done_at for p in self.receives)
        link = side.options.link
        if link is not None:  # the simulated link delivers the bytes later than gloo did
            nbytes = sum(p.nbytes for p in self.receives)
            arrived += link.cost_s("recv", nbytes)
            time.sleep(max(0.0, arrived - time.perf_counter()))
        self.delivered_ns = int(arrived * 1e9)
        hidden_size = side.shape.hidden_size
        combined = torch.zeros(dispatch.tokens, hidden_size)
        for ffn, buffer, count, index in zip(side.peers, self.inbox, dispatch.counts, dispatch.indices, strict=True):
            expected = wire.item_header(wire.KIND_COMBINE, ffn, side.link.rank, item, count)
            got = wire.Header.read(wire.header_view(buffer))
            wire.validate_header(got, expected, peer_name=side.link.describe(ffn), what="combine", me=side.link.me)
            if count:
                combined.index_add_(0, index, wire.combine_rows(buffer, hidden_size, count))
        side.give_back(self.inbox)
        self._result = combined
        return combined


class RoundTripAttentionSide(AttentionSide):
    """Phase logic of an attention rank whose caller waits for each item; see the module docstring."""

    def __init__(
        self, link: PeerLink, shape: P2pShape, options: P2pOptions, *, source: RoutedSource, sink: Sink
    ) -> None:
        super().__init__(link, shape, options)
        self.source = source
        self.sink = sink
        # a sink that did not opt in keeps the tensor contract (a wrapper reads ``result.shape``)
        self.sink_accepts_in_flight = getattr(sink, ACCEPTS_IN_FLIGHT, False) is True
        self._free_inboxes: list[list[torch.Tensor]] = []
        self._inbox_lock = threading.Lock()

    def _take_inbox(self) -> list[torch.Tensor]:
        """Per FFN rank, uint8 [header + max_tokens * H * 4]: where one item's combines land."""
        with self._inbox_lock:
            if self._free_inboxes:
                return self._free_inboxes.pop()
        size = wire.combine_nbytes(self.shape.hidden_size, self.capacity)
        return [torch.empty(size, dtype=torch.uint8) for _ in self.peers]

    def give_back(self, inbox: list[torch.Tensor]) -> None:
        """An inbox whose combines were read (by :meth:`CombineInFlight.wait`) may take another item's."""
        with self._inbox_lock:
            self._free_inboxes.append(inbox)

    def on_recv(self, work: Work) -> None:
        work.transfer["routed"] = self._check_result(work.item, _on_host(self.source(work.item)))

    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        routed = compute(work.item, work.transfer.pop("routed"))
        self._pack(work, self._outputs(work), *self._check_result(work.item, routed))

    def on_send(self, work: Work) -> None:
        item, dispatch, slot = work.item, work.transfer["dispatch"], self._outputs(work)
        hidden_size = self.shape.hidden_size
        inbox = self._take_inbox()
        receives = [
            self.link.irecv(
                buffer[: wire.combine_nbytes(hidden_size, count)], ffn, wire.TAG_COMBINE, f"combine message ({item})"
            )
            for ffn, buffer, count in zip(self.peers, inbox, dispatch.counts, strict=True)
        ]
        self._dispatch(work, slot, dispatch.counts)
        in_flight = CombineInFlight(self, item, dispatch, inbox, receives)
        self.sink(item, in_flight if self.sink_accepts_in_flight else in_flight.wait())

    def on_cleanup(self, work: Work) -> None:
        work.transfer.pop("routed", None)
        super().on_cleanup(work)


def _on_host(routed: Any) -> Any:
    """(hidden, topk_ids, topk_weights) as the wire carries them: host tensors, hidden and weights fp32.

    The caller's tensors may live on an accelerator or be bf16/fp16; anything else
    is passed through for ``_check_result`` to describe.
    """
    if not (isinstance(routed, tuple) and len(routed) == 3 and all(isinstance(t, torch.Tensor) for t in routed)):
        return routed
    hidden, ids, weights = routed
    return hidden.to("cpu", torch.float32), ids.to("cpu"), weights.to("cpu", torch.float32)
