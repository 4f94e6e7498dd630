"""The AFD rank map: roles, expert shards, the names errors use."""

from __future__ import annotations

import pytest

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
    assert [topo.owner_of(e) for e in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
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
    assert all(topo.owner_of(x) == i for i in range(f) for x in topo.experts_of(i))
    ffn_ranks, attention_ranks = list(range(a, a + f)), list(range(a))
    assert all(topo.peers_of(r) == ffn_ranks for r in attention_ranks)
    assert all(topo.peers_of(r) == attention_ranks for r in ffn_ranks)


@pytest.mark.parametrize(
    ("a", "f", "e", "needle"),
    [
        (2, 2, 3, "multiple of num_ffn"),
        (1, 3, 2, "multiple of num_ffn"),
        (0, 1, 2, "at least one"),
        (1, 0, 2, "at least one"),
    ],
)
def test_invalid_topologies(a: int, f: int, e: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Topology(a, f, e)


def test_unknown_rank() -> None:
    with pytest.raises(ValueError, match="outside"):
        Topology(2, 1, 2).role_of(3)
