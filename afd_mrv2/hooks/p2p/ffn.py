"""The FFN side of torch_p2p: :class:`FfnSide`.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.ffn".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.common import P2pOptions, P2pShape, Side, charge_link
from afd_mrv2.hooks.p2p.errors import ProtocolError
from afd_mrv2.hooks.p2p.link import PeerLink
from afd_mrv2.hooks.p2p.stamps import FfnStamps
from afd_mrv2.hookspecs import ComputeFn
from afd_mrv2.items import WorkItem
from afd_mrv2.work import Work


@dataclass
class _Inputs:
    """An input slot: what recv fills and compute reads."""

    headers: torch.Tensor  # [A, HEADER_WORDS] int64, received dispatch headers
    staging: list[torch.Tensor]  # per attention rank, uint8 [max_tokens * row_bytes]
    hidden: torch.Tensor  # [A * max_tokens, H]: inputs of all attention ranks, concatenated (int8 with quant)
    topk_ids: torch.Tensor  # [A * max_tokens, k] int64
    topk_weights: torch.Tensor  # [A * max_tokens, k]
    scales: torch.Tensor | None  # [A * max_tokens] fp32 with quant: the per-token dynamic scales


class FfnSide(Side):
    """Phase logic of an FFN rank; see docs/internals/p2p-transport.md."""

    def __init__(
        self,
        link: PeerLink,
        shape: P2pShape,
        options: P2pOptions,
        *,
        peers: Sequence[int] | None = None,
        follow_stages: bool = False,
        on_item: Callable[[WorkItem], None] | None = None,
    ) -> None:
        super().__init__(link, shape, options)
        self.follow_stages = follow_stages
        self.on_item = on_item
        self._last: tuple[int, int, int] | None = None  # follow_stages: (layer, stage, stages) of the last item
        self.held = link.topology.held_by(link.index)  # the experts this rank keeps (with replicas: R blocks)
        self._held = torch.zeros(shape.num_experts, dtype=torch.bool)
        self._held[list(self.held)] = True
        self._holds_all = bool(self._held.all())  # then no row can be mis-routed here: the check is skipped
        self.redispatched = 0  # re-sends served (failovers of the Attention side)
        #: where the items' time here goes (docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.stamps")
        self.stamps = FfnStamps()
        if peers is not None:
            unknown = sorted(set(peers) - set(self.peers))
            if not peers or unknown or len(set(peers)) != len(peers):
                raise ValueError(
                    f"{link.me}: peers must be distinct attention ranks among global ranks {self.peers}, got {list(peers)}"
                )
            self.peers = list(peers)

    def _inputs(self, work: Work) -> _Inputs:
        if work.inputs.state is None:
            n, cap, shape = len(self.peers), self.capacity, self.shape
            work.inputs.state = _Inputs(
                headers=torch.zeros(n, wire.HEADER_WORDS, dtype=torch.int64),
                staging=[torch.empty(self.layout.nbytes(cap), dtype=torch.uint8) for _ in range(n)],
                hidden=torch.empty(n * cap, shape.hidden_size, dtype=self.layout.hidden_dtype),
                topk_ids=torch.empty(n * cap, shape.top_k, dtype=torch.int64),
                topk_weights=torch.empty(n * cap, shape.top_k),
                scales=None if self.layout.quant is None else torch.empty(n * cap),
            )
        inputs: _Inputs = work.inputs.state
        return inputs

    def _outgoing(self, work: Work) -> list[torch.Tensor]:
        """The output slot: per attention rank, uint8 [header + max_tokens * H * 4]."""
        if work.outputs.state is None:
            size = wire.combine_nbytes(self.shape.hidden_size, self.capacity)
            work.outputs.state = [torch.empty(size, dtype=torch.uint8) for _ in self.peers]
        outgoing: list[torch.Tensor] = work.outputs.state
        return outgoing

    # ------------------------------------------------------------------ phases

    def on_recv(self, work: Work) -> None:
        item, slot, link = work.item, self._inputs(work), self.link
        action = f"receiving {item}"
        headers = [
            link.irecv(slot.headers[a], peer, wire.TAG_DISPATCH_HEADER, "dispatch header")
            for a, peer in enumerate(self.peers)
        ]
        self.wait(headers, work, "recv", action)
        counts: list[int] = work.transfer.setdefault("counts", [])  # per-item transfer state, until on_send
        kind = self.layout.kind
        if self.follow_stages:
            first = wire.Header.read(slot.headers[0])
            if first.kind == self.layout.redispatch_kind and first.magic == wire.MAGIC:  # a failover's re-send
                kind = first.kind
                item = WorkItem(first.layer, first.stage, item.seq, num_stages=max(first.stages, 1))
                self.redispatched += 1
            else:
                item = self._follow(first, item, self.peers[0])
            work.transfer["item"] = item
        for a, peer in enumerate(self.peers):
            got = wire.Header.read(slot.headers[a])
            expected = wire.item_header(kind, peer, link.rank, item, tokens=0)
            wire.validate_header(
                got, expected, peer_name=link.describe(peer), what="dispatch", max_tokens=self.capacity, me=link.me
            )
            counts.append(got.tokens)
        if self.on_item is not None:
            self.on_item(item)
        payloads = [
            link.irecv(slot.staging[a][: self.layout.nbytes(n)], peer, wire.TAG_DISPATCH_PAYLOAD, "dispatch payload")
            for a, (peer, n) in enumerate(zip(self.peers, counts, strict=True))
            if n
        ]
        self.wait(payloads, work, "recv", action)
        received = headers + payloads
        # the last frame read: a payload, or the header of an item with no rows here
        work.transfer["payload_done_ns"] = int(max(p.done_at for p in received) * 1e9)
        for a, (peer, n) in enumerate(zip(self.peers, counts, strict=True)):
            if n:
                self._check_routing(slot.staging[a], n, peer)
        charge_link(self.options, work, "recv", received)

    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        item, slot, hidden_size = work.transfer.get("item", work.item), self._inputs(work), self.shape.hidden_size
        counts: list[int] = work.transfer["counts"]
        offsets, total = [], 0
        for n in counts:
            offsets.append(total)
            total += n
        output: torch.Tensor | None = None
        if total:
            payload = self._gather(slot, counts, total)
            called = time.perf_counter_ns()
            output = compute(item, *payload)
            returned = time.perf_counter_ns()
            if not isinstance(output, torch.Tensor) or output.shape != (total, hidden_size):
                got = f"Tensor{list(output.shape)}" if isinstance(output, torch.Tensor) else type(output).__name__
                raise TypeError(f"FFN compute for {item} must return a [{total}, {hidden_size}] tensor, got {got}")
        else:
            called = returned = time.perf_counter_ns()  # no row here: no compute, a span of 0
        outgoing = self._outgoing(work)
        for a, (peer, n, start) in enumerate(zip(self.peers, counts, offsets, strict=True)):
            message = outgoing[a]
            wire.item_header(wire.KIND_COMBINE, self.link.rank, peer, item, n).write(wire.header_view(message))
            if n:
                assert output is not None  # n rows: total > 0, so compute ran and returned a tensor
                wire.combine_rows(message, hidden_size, n).copy_(output[start : start + n])
        work.transfer["compute_ns"] = called, returned

    def _gather(self, slot: _Inputs, counts: list[int], total: int) -> list[torch.Tensor]:
        """compute's arguments: the rows of every attention rank, concatenated (hidden, ids as int64, weights,
        and the scales with quant).  Rows from one attention rank only are read where they landed (no copy of
        hidden and weights: the staging buffer belongs to this slot until compute returned)."""
        senders = [a for a, n in enumerate(counts) if n]
        if len(senders) == 1 and slot.scales is None:
            rows, weights, ids = self.layout.views(slot.staging[senders[0]], total)
            slot.topk_ids[:total].copy_(ids)
            return [rows, slot.topk_ids[:total], weights]
        start = 0
        for a in senders:
            n = counts[a]
            rows, weights, ids = self.layout.views(slot.staging[a], n)
            slot.hidden[start : start + n].copy_(rows)
            slot.topk_weights[start : start + n].copy_(weights)
            slot.topk_ids[start : start + n].copy_(ids)
            if slot.scales is not None:
                slot.scales[start : start + n].copy_(self.layout.scales(slot.staging[a], n))
            start += n
        payload = [slot.hidden[:total], slot.topk_ids[:total], slot.topk_weights[:total]]
        if slot.scales is not None:  # received scales reach compute (docs/internals/p2p-transport.md)
            payload.append(slot.scales[:total])
        return payload

    def on_send(self, work: Work) -> None:
        item, outgoing = work.transfer.get("item", work.item), self._outgoing(work)
        combine_send = time.perf_counter_ns()
        sends = [
            self.link.isend(
                outgoing[a][: wire.combine_nbytes(self.shape.hidden_size, n)],
                peer,
                wire.TAG_COMBINE,
                f"combine message ({item})",
            )
            for a, (peer, n) in enumerate(zip(self.peers, work.transfer["counts"], strict=True))
        ]
        self.wait(sends, work, "send", f"sending the combine of {item}")
        charge_link(self.options, work, "send", sends)
        called, returned = work.transfer["compute_ns"]
        self.stamps.add(work.transfer["payload_done_ns"], called, returned, combine_send)

    def on_cleanup(self, work: Work) -> None:
        # Nothing to cancel (gloo cannot); pending operations keep their buffers alive.
        for key in ("counts", "item", "payload_done_ns", "compute_ns"):
            work.transfer.pop(key, None)

    def _follow(self, got: wire.Header, submitted: WorkItem, peer: int) -> WorkItem:
        """``follow_stages``: the item's layer and stage identity, learned from the first peer's header.

        An owner that cannot know a step's stage count in advance (independent
        engines that split some steps and not others) submits items by sequence
        number only.  The identity then comes from the wire, checked against the
        order every Attention side issues: stages of a layer in order, layers in
        order, and a new stage count only where a step begins (layer 0, stage 0).
        A step may begin after any item: an engine whose micro-batched step failed
        half-way starts its next step at layer 0 (nothing is lost unnoticed: the
        seq of every message is still checked, so an item that never came fails
        the next header).  The other peers' headers are then validated against it as usual, so peers
        that split the same step differently still fail, naming both sides.
        """
        if got.magic != wire.MAGIC:
            return submitted  # not this protocol: the header check that follows names the field
        num_layers = self.shape.num_layers
        if self._last is None:
            allowed = {(0, 0)}
        else:
            layer, stage, stages = self._last
            allowed = {(layer, stage + 1)} if stage + 1 < stages else {((layer + 1) % num_layers, 0)}
        new_step = (got.layer, got.stage) == (0, 0)
        fine = (
            ((got.layer, got.stage) in allowed or new_step)
            and 0 <= got.stage < got.stages
            and (new_step or self._last is None or got.stages == self._last[2])
        )
        if not fine:
            after = (
                "the first item"
                if self._last is None
                else f"layer={self._last[0]} stage {self._last[1]} of {self._last[2]}"
            )
            raise ProtocolError(
                f"malformed dispatch header from {self.link.describe(peer)}: field 'stage' stage identity out of "
                f"order: it sent layer={got.layer} stage {got.stage} of {got.stages} (seq={got.seq}) after {after}; "
                f"{self.link.me} expects {' or '.join(f'layer={layer_} stage {s}' for layer_, s in sorted(allowed))}"
                + ("" if new_step or self._last is None else f" of {self._last[2]} (a step keeps its stage count)"),
                peer=peer,
                peer_name=self.link.describe(peer),
                field="stage",
            )
        self._last = (got.layer, got.stage, got.stages)
        return WorkItem(got.layer, got.stage, submitted.seq, num_stages=got.stages)

    # ------------------------------------------------------------------ checks

    def _check_routing(self, staging: torch.Tensor, tokens: int, peer: int) -> None:
        """Every id in 0..E-1 and every row routed to at least one expert held here: no silent mis-route."""
        _, _, ids = self.layout.views(staging, tokens)
        problem = None
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= self.shape.num_experts:
            problem = f"expert ids must be in 0..{self.shape.num_experts - 1}, got {low}..{high}"
        elif not self._holds_all and not self._held[ids.long()].any(dim=1).all():
            problem = (
                f"a token routed to none of this rank's experts "
                f"{self.link.topology.placement.ranges(self.held)} was dispatched here"
            )
        if problem:
            raise ProtocolError(
                f"malformed dispatch payload from {self.link.describe(peer)}: field 'topk_ids': {problem}",
                peer=peer,
                peer_name=self.link.describe(peer),
                field="topk_ids",
            )
