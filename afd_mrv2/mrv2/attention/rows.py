"""Which rows of a MoE layer's input an Attention process sends: its real tokens, never vLLM's padding, and
under tensor parallelism its share of them.

:class:`RowShare`.  See docs/vllm.md, "Attention groups: data and tensor parallelism (M:N)".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import final

import torch


def _no_mask() -> torch.Tensor | None:
    return None


@final
@dataclass(frozen=True, slots=True)
class RowShare:
    """This process's rows of each MoE call.

    ``padding``: the current forward's padding mask (vLLM's ``ForwardContext.is_padding``, True for each padded
    row; vLLM pads at the end), or None where there is none (:func:`afd_mrv2.mrv2.upstream.load_padding_mask`).
    A data-parallel rank's dummy forward (vLLM runs one on an idle rank in every step of a wave) is padding
    only: its exchange carries 0 rows.  ``tp_size`` / ``tp_rank``: the engine's tensor parallelism; every TP
    rank holds the same rows, each sends its own contiguous share (the MoE runner's all-reduce of the output,
    each rank's rows with zeros elsewhere, completes them).
    """

    tp_size: int = 1
    tp_rank: int = 0
    padding: Callable[[], torch.Tensor | None] = field(default=_no_mask)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in 0..{self.tp_size - 1}, got {self.tp_rank}")

    def real(self, rows: int) -> int:
        """How many of ``rows`` (a MoE call's input) are real tokens: all where the forward has no mask of that
        length."""
        mask = self.padding()
        if mask is None or mask.shape[0] != rows:
            return rows
        return rows - int(mask.sum())

    def span(self, rows: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of a ``rows``-row call this process sends."""
        real = self.real(rows)
        return real * self.tp_rank // self.tp_size, real * (self.tp_rank + 1) // self.tp_size
