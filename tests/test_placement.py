"""The expert-to-holders table with replicas: distinct holders, even load, survival, deterministic routing."""

from __future__ import annotations

import itertools

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
        ((9, 2, 1), "must be a multiple of the FFN ranks"),
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
