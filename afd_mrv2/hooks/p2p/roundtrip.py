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
                rank, wait for every combine, sum the partials in token order and
                hand the [T, H] result to the ``sink`` resource

The FFN side is unchanged (:mod:`afd_mrv2.hooks.p2p.ffn`): it sees the same
messages as from the pipelined side, item ``(layer, stage, seq)`` by item.
The combine receive is posted before the dispatch is sent, so the FFN rank's
combine send (a gloo rendezvous) never waits on this side.

Selected by the owner's resources: an attention owner that provides ``source``
and ``sink`` (the contract of :class:`~afd_mrv2.mrv2.exchange.UBatchExchange`)
gets this side; one that provides neither drives the pipelined side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.attention import AttentionSide, _Outputs
from afd_mrv2.hooks.p2p.common import P2pOptions, P2pShape, charge_link
from afd_mrv2.hooks.p2p.link import PeerLink
from afd_mrv2.hookspecs import ComputeFn
from afd_mrv2.items import WorkItem
from afd_mrv2.work import Work

RoutedSource = Callable[[WorkItem], Any]
Sink = Callable[[WorkItem, torch.Tensor], None]


@dataclass
class _RoundTripOutputs(_Outputs):
    """An output slot: the dispatch (headers, staging) and where its combines land (``inbox``)."""

    inbox: list[torch.Tensor]  # per FFN rank, uint8 [header + max_tokens * H * 4]


class RoundTripAttentionSide(AttentionSide):
    """Phase logic of an attention rank whose caller waits for each item; see the module docstring."""

    def __init__(
        self, link: PeerLink, shape: P2pShape, options: P2pOptions, *, source: RoutedSource, sink: Sink
    ) -> None:
        super().__init__(link, shape, options)
        self.source = source
        self.sink = sink

    def _outputs(self, work: Work) -> _RoundTripOutputs:
        if work.outputs.state is None:
            n = len(self.peers)
            combine = wire.combine_nbytes(self.shape.hidden_size, self.capacity)
            work.outputs.state = _RoundTripOutputs(
                headers=torch.zeros(n, wire.HEADER_WORDS, dtype=torch.int64),
                staging=[torch.empty(self.layout.nbytes(self.capacity), dtype=torch.uint8) for _ in range(n)],
                inbox=[torch.empty(combine, dtype=torch.uint8) for _ in range(n)],
            )
        state: _RoundTripOutputs = work.outputs.state
        return state

    def on_recv(self, work: Work) -> None:
        work.transfer["routed"] = self._check_result(work.item, _on_host(self.source(work.item)))

    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        routed = compute(work.item, work.transfer.pop("routed"))
        self._pack(work, self._outputs(work), *self._check_result(work.item, routed))

    def on_send(self, work: Work) -> None:
        item, dispatch, slot = work.item, work.transfer["dispatch"], self._outputs(work)
        hidden_size = self.shape.hidden_size
        receives = [
            self.link.irecv(
                buffer[: wire.combine_nbytes(hidden_size, count)], ffn, wire.TAG_COMBINE, f"combine message ({item})"
            )
            for ffn, buffer, count in zip(self.peers, slot.inbox, dispatch.counts, strict=True)
        ]
        self._dispatch(work, slot, dispatch.counts)
        self.wait(receives, work, "recv", f"receiving the combine of {item}")
        charge_link(self.options, work, "recv", receives)
        combined = torch.zeros(dispatch.tokens, hidden_size)
        for ffn, buffer, count, index in zip(self.peers, slot.inbox, dispatch.counts, dispatch.indices, strict=True):
            expected = wire.item_header(wire.KIND_COMBINE, ffn, self.link.rank, item, count)
            got = wire.Header.read(wire.header_view(buffer))
            wire.validate_header(got, expected, peer_name=self.link.describe(ffn), what="combine", me=self.link.me)
            if count:
                combined.index_add_(0, index, wire.combine_rows(buffer, hidden_size, count))
        self.sink(item, combined)

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
