"""The torch_p2p hooks' checks of what they are handed, on a zmq loopback pair: the routing from the source and
from compute (also when compute changed the checked tensors in place), a dispatch payload's ids at the FFN
rank (a few ids read in Python, many by torch: the same error), and the combine's sum."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from afd_mrv2.hooks.p2p import P2pShape, ProtocolError, parse_options, wire
from afd_mrv2.hooks.p2p.buffers import SCAN_IDS, CombineBuffer
from afd_mrv2.hooks.p2p.ffn import FfnSide
from afd_mrv2.hooks.p2p.link import PeerLink
from afd_mrv2.hooks.p2p.roundtrip import RoundTripAttentionSide, Share, _sum
from afd_mrv2.items import WorkItem
from afd_mrv2.topology import Topology
from afd_mrv2.work import INPUT, OUTPUT, BufferSlot, Work
from tests.hooks.p2p.channel_links import channel_links

HIDDEN, TOP_K, EXPERTS = 8, 2, 4
MANY = SCAN_IDS // TOP_K + 1  # tokens whose ids are more than SCAN_IDS: checked by torch, not in Python


def _work(seq: int = 0) -> Work:
    inputs, outputs = BufferSlot(INPUT, 0, None, None), BufferSlot(OUTPUT, 0, None, None)  # type: ignore[arg-type]
    return Work(WorkItem(0, 0, seq), inputs, outputs, threading.Event())


def _routed(tokens: int, bad_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.arange(tokens * TOP_K).view(tokens, TOP_K) % EXPERTS
    if bad_id is not None:
        ids[tokens // 2, 1] = bad_id
    return torch.randn(tokens, HIDDEN), ids, torch.rand(tokens, TOP_K)


@pytest.fixture
def links() -> Iterator[tuple[PeerLink, PeerLink]]:
    """(Attention rank 0's link, FFN rank 0's link) of 1A2F (the FFN rank holds experts 0 and 1 of 4), on one
    zmq pair; the other FFN rank is never talked to."""
    with channel_links(Topology(1, 2, EXPERTS), "zmq") as pair:
        yield pair


def _attention(link: PeerLink, source: Callable[[WorkItem], Any]) -> RoundTripAttentionSide:
    shape = P2pShape(HIDDEN, TOP_K, EXPERTS, num_layers=1, max_tokens=2 * MANY)
    return RoundTripAttentionSide(link, shape, parse_options({}), source=source, sink=lambda item, result: None)


@pytest.mark.parametrize("tokens", [3, MANY])
@pytest.mark.parametrize("bad_id", [-1, EXPERTS])
def test_routing_from_the_source_with_an_id_out_of_range_fails_in_recv(
    links: tuple[PeerLink, PeerLink], tokens: int, bad_id: int
) -> None:
    side = _attention(links[0], lambda item: _routed(tokens, bad_id))
    with pytest.raises(TypeError, match=rf"ids in 0\.\.{EXPERTS - 1}; got \(Tensor\[{tokens}, {HIDDEN}\]"):
        side.on_recv(_work())


@pytest.mark.parametrize("inference", [False, True])
def test_compute_that_changed_the_checked_ids_in_place_is_checked_again(
    links: tuple[PeerLink, PeerLink], inference: bool
) -> None:
    """on_compute skips the check of an unchanged routing it checked in on_recv, not one changed in place
    (inference tensors keep no version counter: always checked again)."""
    with torch.inference_mode(inference):
        routed = _routed(3)
        side = _attention(links[0], lambda item: routed)
        work = _work()
        side.on_recv(work)

        def compute(item: WorkItem, value: Any) -> Any:
            value[1][0, 0] = EXPERTS
            return value

        with pytest.raises(TypeError, match=rf"ids in 0\.\.{EXPERTS - 1}"):
            side.on_compute(work, compute)


def _dispatch(link: PeerLink, ids: torch.Tensor) -> None:
    """What an Attention rank would send FFN rank 0 (global rank 1) for item 0: a header and a payload."""
    tokens = ids.shape[0]
    layout = wire.DispatchLayout(HIDDEN, TOP_K)
    header = torch.tensor(wire.item_words(layout.kind, 0, 1, WorkItem(0, 0, 0), tokens), dtype=torch.int64)
    payload = torch.zeros(layout.nbytes(tokens), dtype=torch.uint8)
    layout.views(payload, tokens)[2].copy_(ids)
    link.isend(header, 1, wire.TAG_DISPATCH_HEADER, "dispatch header")
    link.isend(payload, 1, wire.TAG_DISPATCH_PAYLOAD, "dispatch payload")


@pytest.mark.parametrize("tokens", [3, MANY])
@pytest.mark.parametrize(
    ("bad_id", "problem"),
    [
        (EXPERTS + 3, rf"expert ids must be in 0\.\.{EXPERTS - 1}, got 0\.\.{EXPERTS + 3}"),
        (-2, rf"expert ids must be in 0\.\.{EXPERTS - 1}, got -2\.\.1"),
        (2, r"a token routed to none of this rank's experts"),
    ],
)
def test_a_payload_whose_ids_are_not_this_ranks_fails_naming_the_field(
    links: tuple[PeerLink, PeerLink], tokens: int, bad_id: int, problem: str
) -> None:
    attention_link, ffn_link = links
    ids = torch.arange(tokens * TOP_K).view(tokens, TOP_K) % 2  # experts 0 and 1: this rank's
    ids[tokens // 2] = bad_id  # a row with no pair here
    _dispatch(attention_link, ids)
    side = FfnSide(ffn_link, P2pShape(HIDDEN, TOP_K, EXPERTS, num_layers=1, max_tokens=2 * MANY), parse_options({}))
    with pytest.raises(ProtocolError, match=rf"field 'topk_ids': {problem}") as info:
        side.on_recv(_work())
    assert info.value.field == "topk_ids" and info.value.peer == 0


def _share(ffn: int, index: list[int], rows: torch.Tensor) -> Share:
    buffer = CombineBuffer.empty(HIDDEN, len(index))
    buffer.at(len(index)).rows.copy_(rows)
    return Share(ffn, 0, torch.tensor(index, dtype=torch.long), torch.ones(len(index), TOP_K, dtype=torch.bool), buffer)


def _added_onto_zeros(shares: list[Share], tokens: int) -> torch.Tensor:
    combined = torch.zeros(tokens, HIDDEN)
    for share in shares:
        combined.index_add_(0, share.index, share.buffer.at(share.count).rows)
    return combined


def _summed(shares: list[Share], tokens: int) -> torch.Tensor:
    combined = torch.zeros(tokens, HIDDEN)
    _sum(shares, combined)
    return combined


def test_the_combine_is_the_partials_added_onto_zeros_bit_for_bit() -> None:
    """One partial of every row (one operation) and several partials give what index_add_ onto zeros gives:
    -0.0 comes back as 0.0, NaN as NaN."""
    rows = torch.randn(4, HIDDEN)
    rows[0, :3] = torch.tensor([-0.0, float("nan"), float("-inf")])
    one = [_share(0, [0, 1, 2, 3], rows)]
    got = _summed(one, 4)
    assert got.view(torch.int32).tolist() == _added_onto_zeros(one, 4).view(torch.int32).tolist()  # the bits
    assert not torch.signbit(got[0, 0]) and torch.isnan(got[0, 1])
    two = [_share(0, [0, 2], rows[:2]), _share(1, [1, 2, 3], rows[1:])]
    assert _summed(two, 4).view(torch.int32).tolist() == _added_onto_zeros(two, 4).view(torch.int32).tolist()
    assert _summed([_share(0, [], rows[:0])], 0).shape == (0, HIDDEN)
