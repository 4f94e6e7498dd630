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
    assert [topo.home(a) for a in range(4)] == [0, 0, 1, 1]
    assert topo.describe(5) == "FFN rank 1 (global rank 5)"
    assert topo.describe(2) == "attention rank 2 (global rank 2)"


@pytest.mark.parametrize(
    ("a", "f", "e", "needle"),
    [(1, 2, 4, "must divide"), (3, 2, 4, "must divide"), (2, 2, 3, "multiple of num_ffn"), (0, 1, 2, "at least one")],
)
def test_invalid_topologies(a: int, f: int, e: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Topology(a, f, e)


def test_unknown_rank() -> None:
    with pytest.raises(ValueError, match="outside"):
        Topology(2, 1, 2).role_of(3)
