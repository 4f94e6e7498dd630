"""The FFN side of torch_p2p: :class:`FfnSide`.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.ffn".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.buffers import CombineBuffer, DispatchBuffer, DispatchViews, HeaderSlot, Prefixes, id_range
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

    headers: list[HeaderSlot]  # per attention rank, its received dispatch header
    staging: list[DispatchBuffer]  # per attention rank, uint8 [max_tokens * row_bytes]
    hidden: torch.Tensor  # [A * max_tokens, H]: inputs of all attention ranks, concatenated (int8 with quant)
    topk_ids: Prefixes  # [A * max_tokens, k] int64
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
        on_rows: Callable[[WorkItem, Sequence[int]], None] | None = None,
    ) -> None:
        super().__init__(link, shape, options)
        self.follow_stages = follow_stages
        self.on_item = on_item
        self.on_rows = on_rows
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
        #: follow_stages: the next message number of each peer's pair, and headers received but not yet served
        self._seq = [0] * len(self.peers)
        self._stash: dict[int, tuple[int, ...]] = {}

    def _inputs(self, work: Work) -> _Inputs:
        if work.inputs.state is None:
            n, cap, shape, layout = len(self.peers), self.capacity, self.shape, self.layout
            headers = torch.zeros(n, wire.HEADER_WORDS, dtype=torch.int64)
            work.inputs.state = _Inputs(
                headers=[HeaderSlot(words) for words in headers],
                staging=[DispatchBuffer(torch.empty(layout.nbytes(cap), dtype=torch.uint8), layout) for _ in range(n)],
                hidden=torch.empty(n * cap, shape.hidden_size, dtype=layout.hidden_dtype),
                topk_ids=Prefixes(torch.empty(n * cap, shape.top_k, dtype=torch.int64)),
                topk_weights=torch.empty(n * cap, shape.top_k),
                scales=None if self.layout.quant is None else torch.empty(n * cap),
            )
        inputs: _Inputs = work.inputs.state
        return inputs

    def _outgoing(self, work: Work) -> list[CombineBuffer]:
        """The output slot: per attention rank, uint8 [header + max_tokens * H * 4]."""
        if work.outputs.state is None:
            work.outputs.state = [CombineBuffer.empty(self.shape.hidden_size, self.capacity) for _ in self.peers]
        outgoing: list[CombineBuffer] = work.outputs.state
        return outgoing

    # ------------------------------------------------------------------ phases

    def on_recv(self, work: Work) -> None:
        item, slot, link = work.item, self._inputs(work), self.link
        action = f"receiving {item}"
        fresh = [i for i in range(len(self.peers)) if i not in self._stash]
        headers = [
            link.irecv(slot.headers[i].tensor, self.peers[i], wire.TAG_DISPATCH_HEADER, "dispatch header")
            for i in fresh
        ]
        self.wait(headers, work, "recv", action)
        words = [self._stash.pop(i) if i not in fresh else slot.headers[i].words() for i in range(len(self.peers))]
        kind, served = self.layout.kind, list(range(len(self.peers)))
        if self.follow_stages:
            item, kind, served = self._identify(words, item)
            work.transfer["item"] = item
        seqs = [self._expected_seq(i, item) for i in range(len(self.peers))]
        for i in served:
            expected = wire.item_words(kind, self.peers[i], link.rank, item, 0, seqs[i])
            wire.check_words(words[i], expected, what="dispatch", describe=link.describe, max_tokens=self.capacity)
            if self.follow_stages:
                self._seq[i] += 1
        # per-item transfer state, until on_send: every peer's rows (0 for one not served by this item), whom it
        # answers, and with which message numbers
        counts = work.transfer["counts"] = [words[i][-1] if i in served else 0 for i in range(len(self.peers))]
        work.transfer["served"], work.transfer["seqs"] = served, seqs
        if self.on_item is not None:
            self.on_item(item)
        work.transfer["name"] = str(item)  # for on_send's messages, made here: not next to the compute
        payloads = [
            link.irecv(staging.at(n).message, peer, wire.TAG_DISPATCH_PAYLOAD, "dispatch payload")
            for staging, peer, n in zip(slot.staging, self.peers, counts, strict=True)
            if n
        ]
        self.wait(payloads, work, "recv", action)
        received = headers + payloads
        # the last frame read: a payload, or the header of an item with no rows here
        work.transfer["payload_done_ns"] = int(max((p.done_at for p in received), default=time.perf_counter()) * 1e9)
        for staging, peer, n in zip(slot.staging, self.peers, counts, strict=True):
            if n:
                self._check_routing(staging.at(n), peer)
        if self.options.link is not None:
            charge_link(self.options, work, "recv", received)

    def _identify(self, words: list[tuple[int, ...]], submitted: WorkItem) -> tuple[WorkItem, int, list[int]]:
        """``follow_stages``: what this item is, learned from the peers' headers: (item, kind, the peers it
        serves).  A failover's re-send from one peer (kind ``redispatch``) is served alone, as it comes: the
        other peers' headers, the next item of the group or re-sends of their own, wait for the next item
        (:attr:`_stash`), so re-sends from several ranks of a group, interleaved with the group's next items
        in any order, are each served once.  Otherwise the first peer's header names the group's item
        (:meth:`_follow`)."""
        for i, got in enumerate(words):
            if got[0] == wire.MAGIC and got[1] == self.layout.redispatch_kind:
                self._stash.update((j, w) for j, w in enumerate(words) if j != i)
                self.redispatched += 1
                item = WorkItem(got[4], got[5], submitted.seq, num_stages=max(got[6], 1))
                return item, got[1], [i]
        return self._follow(words[0], submitted, self.peers[0]), self.layout.kind, list(range(len(words)))

    def _expected_seq(self, i: int, item: WorkItem) -> int:
        """The message number peer ``i``'s next header must carry: its own count on the pair with
        ``follow_stages`` (re-sends make the pairs of a group diverge), the item's otherwise."""
        return self._seq[i] if self.follow_stages else item.seq

    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        item, slot, hidden_size = work.transfer.get("item", work.item), self._inputs(work), self.shape.hidden_size
        counts: list[int] = work.transfer["counts"]
        total = sum(counts)
        if self.on_rows is not None:
            self.on_rows(item, counts)
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
        start, rank, outgoing, seqs = 0, self.link.rank, self._outgoing(work), work.transfer["seqs"]
        for i in work.transfer["served"]:
            message, peer, n = outgoing[i], self.peers[i], counts[i]
            message.header.write(wire.item_words(wire.KIND_COMBINE, rank, peer, item, n, seqs[i]))
            if n:
                assert output is not None  # n rows: total > 0, so compute ran and returned a tensor
                message.at(n).rows.copy_(output if n == total else output[start : start + n])
                start += n
        work.transfer["compute_ns"] = called, returned

    def _gather(self, slot: _Inputs, counts: list[int], total: int) -> list[torch.Tensor]:
        """compute's arguments: the rows of every attention rank, concatenated (hidden, ids as int64, weights,
        and the scales with quant).  Rows from one attention rank only are read where they landed (no copy of
        hidden and weights: the staging buffer belongs to this slot until compute returned)."""
        senders = [a for a, n in enumerate(counts) if n]
        ids = slot.topk_ids.at(total)
        if len(senders) == 1 and slot.scales is None:
            views = slot.staging[senders[0]].at(total)
            ids.copy_(views.ids)
            return [views.hidden, ids, views.weights]
        start = 0
        for a in senders:
            n = counts[a]
            views = slot.staging[a].at(n)
            slot.hidden[start : start + n].copy_(views.hidden)
            slot.topk_weights[start : start + n].copy_(views.weights)
            ids[start : start + n].copy_(views.ids)
            if slot.scales is not None:
                assert views.scales is not None  # a quantized layout has scales
                slot.scales[start : start + n].copy_(views.scales)
            start += n
        payload = [slot.hidden[:total], ids, slot.topk_weights[:total]]
        if slot.scales is not None:  # received scales reach compute (docs/internals/p2p-transport.md)
            payload.append(slot.scales[:total])
        return payload

    def on_send(self, work: Work) -> None:
        outgoing = self._outgoing(work)
        combine_send, name = time.perf_counter_ns(), work.transfer["name"]
        what = "combine message (" + name + ")"
        counts = work.transfer["counts"]
        sends = [
            self.link.isend(outgoing[i].at(counts[i]).message, self.peers[i], wire.TAG_COMBINE, what)
            for i in work.transfer["served"]
        ]
        self.wait(sends, work, "send", "sending the combine of " + name)
        if self.options.link is not None:
            charge_link(self.options, work, "send", sends)
        called, returned = work.transfer["compute_ns"]
        self.stamps.add(work.transfer["payload_done_ns"], called, returned, combine_send)

    def on_cleanup(self, work: Work) -> None:
        # Nothing to cancel (gloo cannot); pending operations keep their buffers alive.
        for key in ("counts", "served", "seqs", "item", "name", "payload_done_ns", "compute_ns"):
            work.transfer.pop(key, None)

    def _follow(self, words: tuple[int, ...], submitted: WorkItem, peer: int) -> WorkItem:
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
        magic, _, _, _, layer, stage, stages, _, _ = words
        if magic != wire.MAGIC:
            return submitted  # not this protocol: the header check that follows names the field
        last = self._last
        if last is None:
            allowed = (0, 0)
        elif last[1] + 1 < last[2]:
            allowed = (last[0], last[1] + 1)
        else:
            allowed = ((last[0] + 1) % self.shape.num_layers, 0)
        new_step = layer == 0 and stage == 0
        fine = (
            ((layer, stage) == allowed or new_step)
            and 0 <= stage < stages
            and (new_step or last is None or stages == last[2])
        )
        if not fine:
            raise self._out_of_order(wire.Header.from_words(words), allowed, peer)
        self._last = (layer, stage, stages)
        return WorkItem(layer, stage, submitted.seq, num_stages=stages)

    def _out_of_order(self, got: wire.Header, allowed: tuple[int, int], peer: int) -> ProtocolError:
        """:meth:`_follow`'s error: ``got`` is not the item ``allowed`` (layer, stage) after the last one."""
        new_step = (got.layer, got.stage) == (0, 0)
        after = (
            "the first item"
            if self._last is None
            else f"layer={self._last[0]} stage {self._last[1]} of {self._last[2]}"
        )
        return ProtocolError(
            f"malformed dispatch header from {self.link.describe(peer)}: field 'stage' stage identity out of "
            f"order: it sent layer={got.layer} stage {got.stage} of {got.stages} (seq={got.seq}) after {after}; "
            f"{self.link.me} expects layer={allowed[0]} stage {allowed[1]}"
            + ("" if new_step or self._last is None else f" of {self._last[2]} (a step keeps its stage count)"),
            peer=peer,
            peer_name=self.link.describe(peer),
            field="stage",
        )

    # ------------------------------------------------------------------ checks

    def _check_routing(self, payload: DispatchViews, peer: int) -> None:
        """Every id of a (non-empty) payload in 0..E-1 and every row routed to at least one expert held here: no
        silent mis-route."""
        problem = None
        low, high = id_range(payload.ids, payload.id_words)
        if low < 0 or high >= self.shape.num_experts:
            problem = f"expert ids must be in 0..{self.shape.num_experts - 1}, got {low}..{high}"
        elif not self._holds_all and not self._held[payload.ids.long()].any(dim=1).all():
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
