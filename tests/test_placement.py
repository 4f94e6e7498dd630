"""The expert-to-holders table: the ring with replicas (E % F == 0 or not), any table, refusals, the digest;
distinct holders, even load, survival, deterministic routing."""

from __future__ import annotations

import hashlib
import itertools
import json

import pytest

from afd_mrv2.errors import AfdError
from afd_mrv2.placement import NoLiveHolder, Placement, PlacementError
from afd_mrv2.topology import Topology


def test_f3_r2_two_distinct_holders_even_load_and_any_single_loss_survived() -> None:
    p = Placement(num_experts=12, num_ffn=3, replicas=2)
    for e, holders in enumerate(p.holders):
        assert len(holders) == 2 and len(set(holders)) == 2, (e, holders)
    loads = [len(p.held_by(f)) for f in range(3)]
    assert loads == [8, 8, 8]  # R * E / F each
    primaries = [sum(1 for h in p.holders if h[0] == f) for f in range(3)]
    assert primaries == [4, 4, 4]
    for lost in range(3):
        assert p.survives([lost])
        live = [f for f in range(3) if f != lost]
        routing = p.routing(live)
        assert lost not in routing
        # only the lost rank's experts moved, and each to a rank that already holds it
        for e, (now, before) in enumerate(zip(routing, p.routing(range(3)), strict=True)):
            assert now == before or before == lost, (e, now, before)
            assert e in p.held_by(now)
    assert not p.survives([0, 1])  # R = 2: two losses can leave an expert without a holder


@pytest.mark.parametrize(("experts", "ffn", "replicas"), [(8, 1, 1), (8, 2, 1), (8, 2, 2), (12, 3, 3), (16, 4, 3)])
def test_any_r_minus_1_losses_are_survived_and_r_equal_1_is_todays_blocks(experts, ffn, replicas) -> None:
    p = Placement(experts, ffn, replicas)
    assert {len(p.held_by(f)) for f in range(ffn)} == {replicas * experts // ffn}
    for lost in itertools.combinations(range(ffn), replicas - 1):
        assert p.survives(lost)
        assert p.routing(f for f in range(ffn) if f not in lost)
    topo = Topology(1, ffn, experts)
    assert [p.holders[e][0] for e in range(experts)] == [topo.primary_of(e) for e in range(experts)]
    if replicas == 1:
        assert [p.held_by(f) for f in range(ffn)] == [tuple(topo.experts_of(f)) for f in range(ffn)]


def test_routing_is_deterministic_primary_first() -> None:
    p = Placement(8, 4, 2)
    assert p.routing(range(4)) == tuple(e // 2 for e in range(8))
    assert p.route(0, [1, 2, 3]) == 1 and p.route(7, [0, 1, 2]) == 0  # the ring successor
    assert p.routing([3, 1, 2]) == p.routing([1, 2, 3])  # the order of the live set does not matter


def test_no_live_holder_names_the_expert_and_its_holders() -> None:
    p = Placement(6, 3, 2)
    with pytest.raises(NoLiveHolder, match=r"expert 0 has no live holder: its holders \[0, 1\] are all lost"):
        p.routing([2])


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ((8, 2, 0), "expert_replicas must be in 1..2"),
        ((8, 2, 3), "expert_replicas must be in 1..2"),
        ((1, 2, 1), r"num_experts \(1\) must be at least the FFN ranks \(2\): every FFN rank holds an expert"),
        ((8, 0, 1), "at least one FFN rank"),
    ],
)
def test_bad_placement_is_refused_in_one_line(args, text) -> None:
    with pytest.raises(PlacementError, match=text) as refused:
        Placement(*args)
    assert isinstance(refused.value, AfdError) and isinstance(refused.value, ValueError)
    assert "\n" not in str(refused.value)


def test_describe_lists_each_ranks_experts_as_ranges() -> None:
    assert Placement(12, 3, 2).describe() == [
        "FFN rank 0: experts 0-3,8-11 (8; primary 0-3)",
        "FFN rank 1: experts 0-7 (8; primary 4-7)",
        "FFN rank 2: experts 4-11 (8; primary 8-11)",
    ]


@pytest.mark.parametrize(
    ("experts", "ffn", "blocks"),
    [(10, 3, [(0, 4), (4, 7), (7, 10)]), (9, 2, [(0, 5), (5, 9)]), (5, 4, [(0, 2), (2, 3), (3, 4), (4, 5)])],
)
def test_the_ring_with_e_not_divisible_by_f_gives_the_first_e_mod_f_ranks_one_expert_more(experts, ffn, blocks) -> None:
    p = Placement.ring(experts, ffn)
    assert [p.held_by(f) for f in range(ffn)] == [tuple(range(a, b)) for a, b in blocks]
    assert p == Placement(experts, ffn) and p.is_ring and p.replicas == 1
    two = Placement.ring(experts, ffn, 2)  # each block also on the next rank around the ring
    assert all(h == (h[0], (h[0] + 1) % ffn) for h in two.holders)
    assert all(two.survives([lost]) for lost in range(ffn))
    assert [two.primary(f) for f in range(ffn)] == [tuple(range(a, b)) for a, b in blocks]


def test_the_ring_where_f_divides_e_is_the_old_contiguous_blocks() -> None:
    assert Placement.ring(8, 4, 2).holders == tuple((e // 2, (e // 2 + 1) % 4) for e in range(8))


def test_any_table_holds_routes_survives_and_describes_as_given() -> None:
    p = Placement.from_table([[0], [0, 2], [1], [2, 1], [1, 0]], 3)
    assert (p.num_experts, p.num_ffn, p.replicas, p.is_ring) == (5, 3, 2, False)
    assert [p.held_by(f) for f in range(3)] == [(0, 1, 4), (2, 3, 4), (1, 3)]
    assert p.routing([0, 1, 2]) == (0, 0, 1, 2, 1) and p.routing([0, 1]) == (0, 0, 1, 1, 1)
    assert p.survives([2]) and not p.survives([0])  # expert 0 has one holder
    assert p.describe() == [
        "FFN rank 0: experts 0-1,4 (3; primary 0-1)",
        "FFN rank 1: experts 2-4 (3; primary 2,4)",
        "FFN rank 2: experts 1,3 (2; primary 3)",
    ]
    assert p.summary == "table, 5 experts on 3 FFN ranks, 1-2 replicas"
    assert Placement.from_table(Placement.ring(6, 3, 2).holders, 3) == Placement.ring(6, 3, 2)  # a round trip
    assert Placement.ring(256, 4, 2).summary == "ring, 256 experts on 4 FFN ranks, 2 replicas"
    assert Placement.ring(8, 2).summary == "ring, 8 experts on 2 FFN ranks, 1 replica"


@pytest.mark.parametrize(
    ("holders", "ffn", "text"),
    [
        ([], 2, "the placement table lists no expert"),
        ([[0], []], 2, "expert 1 has no holder"),
        ([[0], [1, 1]], 2, r"expert 1: holders \[1, 1\] must be 1..2 distinct FFN ranks in 0..1"),
        ([[0], [2]], 2, r"expert 1: holders \[2\] must be 1..2 distinct FFN ranks in 0..1"),
        ([[0], [-1]], 2, r"expert 1: holders \[-1\]"),
        ([[0], [0, 1, 2]], 2, r"expert 1: holders \[0, 1, 2\] must be 1..2"),
        ([[0], [0], [2]], 3, r"FFN rank\(s\) 1 hold no expert; every FFN rank holds one"),
        ([[0]], 0, "need at least one FFN rank"),
    ],
)
def test_a_bad_table_is_refused_in_one_line(holders, ffn, text) -> None:
    with pytest.raises(PlacementError, match=text) as refused:
        Placement.from_table(holders, ffn)
    assert "\n" not in str(refused.value)


def test_a_table_that_disagrees_with_its_counts_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"num_experts \(3\) and replicas \(1\) disagree with the table"):
        Placement(3, 2, 1, ((0,), (1,)))


def test_the_digest_is_stable_and_tells_tables_apart_holder_order_included() -> None:
    ring = Placement.ring(8, 2, 2)
    assert ring.digest == Placement.from_table([list(h) for h in ring.holders], 2).digest
    assert (
        ring.digest
        == "sha256:" + hashlib.sha256(json.dumps([list(h) for h in ring.holders]).replace(" ", "").encode()).hexdigest()
    )
    swapped = Placement.from_table([h[::-1] for h in ring.holders], 2)  # the same holders, other primaries
    assert swapped.held_by(0) == ring.held_by(0) and swapped.digest != ring.digest
    assert len({ring.digest, Placement.ring(8, 2).digest, Placement.ring(8, 4).digest, swapped.digest}) == 4
    assert ring.stamp.short == ring.digest[:15] and ring.stamp.summary == ring.summary
    # pinned: the digest of a known table never changes between releases (two sides of a pair may differ)
    assert Placement.ring(4, 2).digest == "sha256:" + hashlib.sha256(b"[[0],[0],[1],[1]]").hexdigest()


def test_the_table_is_what_afd_placement_takes() -> None:
    assert Placement.from_table([[1, 0], [0]], 2).table() == {"holders": [[1, 0], [0]]}
