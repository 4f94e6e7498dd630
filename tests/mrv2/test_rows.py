"""Which rows of a MoE call an Attention process sends (afd_mrv2.mrv2.attention.rows): never vLLM's padding, and
under tensor parallelism each rank its own share, the shares covering the real rows once."""

from __future__ import annotations

import itertools

import pytest
import torch

from afd_mrv2.mrv2.attention.rows import RowShare


def padded(real: int, rows: int) -> torch.Tensor:
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[real:] = True  # vLLM pads at the end
    return mask


def test_without_a_mask_every_row_is_sent() -> None:
    assert RowShare().span(7) == (0, 7)


def test_padding_rows_never_cross_the_wire_and_a_dummy_forward_sends_none() -> None:
    assert RowShare(padding=lambda: padded(5, 8)).span(8) == (0, 5)
    assert RowShare(padding=lambda: padded(0, 1)).span(1) == (0, 0)  # a DP rank's dummy forward: 0 rows
    assert RowShare(padding=lambda: padded(8, 8)).span(8) == (0, 8)
    assert RowShare(padding=lambda: padded(3, 8)).span(5) == (0, 5)  # a mask of another length: not this call's


@pytest.mark.parametrize(("tp", "real", "rows"), [(2, 5, 8), (2, 1, 1), (3, 10, 16), (4, 3, 4), (2, 0, 1)])
def test_tp_ranks_share_the_real_rows_once(tp: int, real: int, rows: int) -> None:
    spans = [RowShare(tp, r, lambda: padded(real, rows)).span(rows) for r in range(tp)]
    assert spans[0][0] == 0 and spans[-1][1] == real
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous, no row twice
    assert max(stop - start for start, stop in spans) - min(stop - start for start, stop in spans) <= 1


def test_a_rank_outside_its_group_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tp_rank must be in 0\.\.1, got 2"):
        RowShare(2, 2)
