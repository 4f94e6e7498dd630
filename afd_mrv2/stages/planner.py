"""The async-MoE two-stage planner: where to cut one scheduled batch into two stages (``request`` / ``token``).

See docs/internals/async-moe-stages.md, "afd_mrv2.stages.planner".
"""

from __future__ import annotations

import operator
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import SupportsIndex, cast

from afd_mrv2.config import ASYNC_MOE_SPLITS as SPLITS
from afd_mrv2.config import ASYNC_MOE_STAGES as NUM_STAGES


@dataclass(frozen=True)
class Stage:
    """One of the two stages, in the parent batch's coordinates.

    request_slice: the requests with at least one token in this stage (for the
        ``token`` split the crossing request is in both stages' slices).
    token_slice: the stage's real tokens in the parent's flattened order.
    num_input_tokens: physical tokens the stage runs with (>= real tokens; larger
        only under sequence parallelism).
    """

    index: int
    request_slice: slice
    token_slice: slice
    num_input_tokens: int

    @property
    def num_tokens(self) -> int:
        """Real (scheduled) tokens in this stage."""
        start: int = self.token_slice.start
        stop: int = self.token_slice.stop
        return stop - start

    @property
    def num_padding(self) -> int:
        """Physical padding tokens appended after the real ones."""
        return self.num_input_tokens - self.num_tokens

    @property
    def num_requests(self) -> int:
        start: int = self.request_slice.start
        stop: int = self.request_slice.stop
        return stop - start


def plan_stages(
    num_scheduled_tokens: Sequence[int],
    *,
    split: str,
    tp_size: int = 1,
    sequence_parallel: bool = False,
) -> tuple[Stage, Stage] | None:
    """Plan the two stages of one batch; see docs/internals/async-moe-stages.md for the semantics.

    :param num_scheduled_tokens: tokens scheduled per request, in batch order.
    :param split: ``"request"`` or ``"token"``.
    :param tp_size: attention tensor-parallel size (padding unit under SP).
    :param sequence_parallel: pad each stage to a multiple of ``tp_size``.
    :return: two stages, or None when the policy cannot form two non-empty stages.
    :raises ValueError: empty list, a non-positive count, ``tp_size < 1`` or an
        unknown ``split``.
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
    tp = _as_int(tp_size, "tp_size")
    if tp < 1:
        raise ValueError(f"tp_size: expected an integer >= 1, got {tp_size!r}")
    counts = tuple(_as_int(c, "num_scheduled_tokens") for c in num_scheduled_tokens)
    if not counts:
        raise ValueError("num_scheduled_tokens: expected at least one request, got an empty list")
    bad = [(i, c) for i, c in enumerate(counts) if c <= 0]
    if bad:
        i, c = bad[0]
        raise ValueError(f"num_scheduled_tokens[{i}]: expected a positive token count, got {c}")

    cu = tuple(accumulate(counts, initial=0))
    n, total = len(counts), cu[-1]
    if split == "request":
        if n < NUM_STAGES:
            return None
        i = min(range(1, n), key=lambda i: (abs(2 * cu[i] - total), abs(2 * i - n), i))
        bounds = ((slice(0, i), 0, cu[i]), (slice(i, n), cu[i], total))
    else:
        if total < NUM_STAGES:
            return None
        t = (total + 1) // 2
        # requests overlapping [0, t): those starting before t; the request holding token t starts stage 2
        first = slice(0, bisect_left(cu, t))
        second = slice(bisect_right(cu, t) - 1, n)
        bounds = ((first, 0, t), (second, t, total))
    unit = tp if sequence_parallel else 1
    stage_1, stage_2 = (
        Stage(index, requests, slice(start, stop), _round_up(stop - start, unit))
        for index, (requests, start, stop) in enumerate(bounds)
    )
    return stage_1, stage_2


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    try:
        # operator.index is the check: it raises TypeError for a value without __index__
        return operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise ValueError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})") from None
