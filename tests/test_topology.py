"""The AFD rank map: roles, expert shards, the names errors use."""

from __future__ import annotations

import pytest

from afd_mrv2.errors import AfdError
from afd_mrv2.placement import Placement, PlacementError
from afd_mrv2.topology import ATTENTION, FFN, Topology


def test_layout_roles_and_shards() -> None:
    topo = Topology(4, 2, 8)
    assert topo.world_size == 6
    assert [topo.role_of(r) for r in range(6)] == [
        (ATTENTION, 0),
        (ATTENTION, 1),
        (ATTENTION, 2),
        (ATTENTION, 3),
        (FFN, 0),
        (FFN, 1),
    ]
    assert topo.global_rank(FFN, 1) == 5
    assert list(topo.experts_of(0)) == [0, 1, 2, 3] and list(topo.experts_of(1)) == [4, 5, 6, 7]
    assert [topo.primary_of(e) for e in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.peers_of(0) == [4, 5] and topo.peers_of(5) == [0, 1, 2, 3]
    assert topo.describe(5) == "FFN rank 1 (global rank 5)"
    assert topo.describe(2) == "attention rank 2 (global rank 2)"


@pytest.mark.parametrize(("a", "f", "e"), [(3, 2, 6), (2, 3, 6), (1, 2, 4), (5, 3, 9)])
def test_free_topologies(a: int, f: int, e: int) -> None:
    """F need not divide A nor be <= it: every FFN rank serves every attention rank."""
    topo = Topology(a, f, e)
    assert topo.world_size == a + f and str(topo) == f"{a}A{f}F, {e} experts"
    assert [topo.role_of(r) for r in range(a + f)] == [(ATTENTION, i) for i in range(a)] + [(FFN, i) for i in range(f)]
    assert sorted(x for i in range(f) for x in topo.experts_of(i)) == list(range(e))
    assert all(topo.primary_of(x) == i for i in range(f) for x in topo.experts_of(i))
    ffn_ranks, attention_ranks = list(range(a, a + f)), list(range(a))
    assert all(topo.peers_of(r) == ffn_ranks for r in attention_ranks)
    assert all(topo.peers_of(r) == attention_ranks for r in ffn_ranks)


@pytest.mark.parametrize(
    ("a", "f", "e", "needle"),
    [
        (1, 3, 2, r"num_experts \(2\) must be at least the FFN ranks \(3\): every FFN rank holds an expert"),
        (0, 1, 2, "need at least one attention rank, got 0A1F"),
        (1, 0, 2, "need at least one FFN rank, got 0"),
    ],
)
def test_invalid_topologies(a: int, f: int, e: int, needle: str) -> None:
    """One exception type, both a ValueError (as before) and an AfdError (as Placement's were)."""
    with pytest.raises(PlacementError, match=needle) as refused:
        Topology(a, f, e)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, AfdError)


@pytest.mark.parametrize(("f", "e", "r"), [(3, 2, 1), (2, 4, 3), (2, 4, 0), (0, 4, 1)])
def test_topology_refuses_exactly_what_placement_refuses_with_the_same_words(f: int, e: int, r: int) -> None:
    """Topology delegates its checks on FFN ranks, experts and replicas to Placement: one check, one message."""
    with pytest.raises(PlacementError) as by_placement:
        Placement(e, f, r)
    with pytest.raises(PlacementError) as by_topology:
        Topology(1, f, e, r)
    assert str(by_topology.value) == str(by_placement.value)


def test_e_not_divisible_by_f_gives_balanced_blocks_and_a_table_is_carried_as_given() -> None:
    topo = Topology(1, 3, 10)
    assert [topo.experts_of(f) for f in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [topo.primary_of(e) for e in range(10)] == [0] * 4 + [1] * 3 + [2] * 3 and topo.experts_per_ffn == 4
    table = Placement.from_table([[1], [0, 1], [0]], 2)
    over = Topology.over(2, table)
    assert over.placement == table and (over.num_ffn, over.num_experts, over.expert_replicas) == (2, 3, 2)
    assert over.held_by(0) == (1, 2) and over.primary_of(0) == 1
    assert str(over) == f"2A2F, 3 experts, 2 replicas, placement {table.stamp.short}"
    with pytest.raises(PlacementError, match=r"FFN rank 1's primary experts 0,2 are not one block"):
        Topology.over(1, Placement.from_table([[1], [0], [1]], 2)).experts_of(1)
    assert Topology.over(1, Placement.ring(8, 2)) == Topology(1, 2, 8, 1, Placement.ring(8, 2).holders)


def test_owner_of_is_the_deprecated_name_of_primary_of() -> None:
    topo = Topology(1, 2, 8, 2)
    with pytest.warns(DeprecationWarning, match=r"Topology.owner_of is deprecated .*: use Topology.primary_of"):
        owners = [topo.owner_of(e) for e in range(8)]
    assert owners == [topo.primary_of(e) for e in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [topo.placement.holders[e][0] for e in range(8)] == owners  # the placement's primaries


def test_unknown_rank() -> None:
    with pytest.raises(ValueError, match="outside"):
        Topology(2, 1, 2).role_of(3)
