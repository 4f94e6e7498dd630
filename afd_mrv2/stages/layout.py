"""Attention-side token layouts of the async-MoE stages: SP and plain TP, three token counts, one decision.

:class:`StageLayout`, :func:`decide_split`, :func:`layout_line`.

See docs/internals/async-moe-stages.md, "afd_mrv2.stages.layout".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from afd_mrv2 import envs
from afd_mrv2.stages.planner import Stage

if TYPE_CHECKING:
    import torch

LAYOUTS = ("sp", "tp")

#: ``exchange(values) -> one row per rank of the group``: an all-gather of a few ints.
Exchange = Callable[[Sequence[int]], Sequence[Sequence[int]]]


def layout_log_enabled() -> bool:
    """True when ``AFD_MRV2_LAYOUT_LOG`` (or its retired name ``AFD_ASYNC_MOE_LAYOUT_LOG``) is on (:func:`afd_mrv2.envs.layout_log`)."""
    return envs.layout_log()


def round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


@dataclass(frozen=True)
class StageLayout:
    """The rows of one stage of one step on one TP rank; see docs/internals/async-moe-stages.md."""

    index: int
    num_stages: int  # 2 for a split step, 1 for an unsplit one
    layout: str  # "sp" or "tp"
    tp_size: int
    tp_rank: int
    real_tokens: int
    dp_padding: int  # parent DP padding carried by this stage (only an unsplit step carries it)
    tp_padding: int  # stage-local TP/SP padding

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside 0..{self.tp_size - 1}")
        if min(self.real_tokens, self.dp_padding, self.tp_padding) < 0 or self.physical_tokens % self.tp_size:
            raise ValueError(f"stage {self.index}: {self} does not shard evenly over {self.tp_size} TP ranks")

    @property
    def physical_tokens(self) -> int:
        """Rows the stage runs with: real tokens, then DP padding, then TP/SP padding."""
        return self.real_tokens + self.dp_padding + self.tp_padding

    @property
    def shard_tokens(self) -> int:
        return self.physical_tokens // self.tp_size

    @property
    def shard(self) -> slice:
        """This TP rank's rows of the stage's physical rows."""
        n = self.shard_tokens
        return slice(self.tp_rank * n, (self.tp_rank + 1) * n)

    @property
    def split(self) -> bool:
        return self.num_stages > 1

    def as_dict(self) -> dict[str, object]:
        """The fields plus the derived rows (for reports)."""
        return {
            **{f: getattr(self, f) for f in self.__dataclass_fields__},
            "physical_tokens": self.physical_tokens,
            "shard": [self.shard.start, self.shard.stop],
        }


def step_layouts(
    stages: Sequence[Stage],
    *,
    dp_max_tokens: int,
    layout: str,
    tp_size: int,
    tp_rank: int,
) -> list[StageLayout]:
    """The layout of each stage of a step; ``stages`` is the planner's two or :func:`unsplit_stage`'s one.

    ``dp_max_tokens``: the largest real token count of the DP group this step
    (the parent batch's physical rows before TP/SP padding).
    """
    real = sum(s.num_tokens for s in stages)
    if dp_max_tokens < real:
        raise ValueError(f"dp_max_tokens ({dp_max_tokens}) is below this rank's {real} real tokens")
    out = []
    for stage in stages:
        dp_padding = dp_max_tokens - real if len(stages) == 1 else 0
        rows = stage.num_tokens + dp_padding
        out.append(
            StageLayout(
                index=stage.index,
                num_stages=len(stages),
                layout=layout,
                tp_size=tp_size,
                tp_rank=tp_rank,
                real_tokens=stage.num_tokens,
                dp_padding=dp_padding,
                tp_padding=round_up(rows, tp_size) - rows,
            )
        )
    return out


def unsplit_stage(lengths: Sequence[int], *, physical_tokens: int | None = None) -> Stage:
    """The one stage of an unsplit step: every request and token (``physical_tokens`` rows, default the real ones)."""
    total = sum(int(n) for n in lengths)
    return Stage(0, slice(0, len(lengths)), slice(0, total), total if physical_tokens is None else physical_tokens)


# ---------------------------------------------------------------------- decision


@dataclass(frozen=True)
class StepDecision:
    """What the DP group decided for one step."""

    split: bool
    dp_max_tokens: int
    why: str  # "" when split, else which rank had no plan


def decide_split(
    can_split: bool,
    tokens: int,
    requests: int,
    exchange: Exchange | None = None,
    *,
    name_of: Callable[[int], str] | None = None,
) -> StepDecision:
    """Split only when every rank of the group can (see docs/internals/async-moe-stages.md).

    ``exchange`` all-gathers ``[can_split, tokens, requests]`` over the ranks that
    step together; None means this rank steps alone (an independent engine).
    ``name_of(i)`` names the group's ``i``-th row in ``why`` (default ``rank i of
    the DP group``).
    """
    mine = [int(can_split), int(tokens), int(requests)]
    rows = [list(r) for r in exchange(mine)] if exchange is not None else [mine]
    if any(len(r) != 3 for r in rows):
        raise ValueError(f"exchange: expected [can_split, tokens, requests] from every rank, got {rows}")
    blocked = [(rank, r) for rank, r in enumerate(rows) if not r[0]]
    why = ""
    if blocked:
        rank, (_, t, n) = blocked[0]
        if exchange is None:
            who = "this rank"
        else:
            who = name_of(rank) if name_of is not None else f"rank {rank} of the DP group"
        why = f"{who} has no two-stage plan ({n} request(s), {t} token(s))"
    return StepDecision(split=not blocked, dp_max_tokens=max(r[1] for r in rows), why=why)


# ---------------------------------------------------------------------- tensors


def pad_rows(rows: torch.Tensor, length: int, value: float = 0) -> torch.Tensor:
    """``rows`` followed by ``length - len(rows)`` rows of ``value``."""
    if rows.shape[0] > length:
        raise ValueError(f"cannot pad {rows.shape[0]} rows down to {length}")
    if rows.shape[0] == length:
        return rows
    out = rows.new_full((length, *rows.shape[1:]), value)
    out[: rows.shape[0]] = rows
    return out


def take_shard(rows: torch.Tensor, layout: StageLayout) -> torch.Tensor:
    """This TP rank's shard of the stage's physical rows."""
    if rows.shape[0] != layout.physical_tokens:
        raise ValueError(f"stage {layout.index}: expected {layout.physical_tokens} physical rows, got {rows.shape[0]}")
    return rows[layout.shard]


def gather_shards(
    shard: torch.Tensor, layout: StageLayout, all_gather: Callable[[torch.Tensor], list[torch.Tensor]]
) -> torch.Tensor:
    """The stage's physical rows from every TP rank's shard (``all_gather`` over the TP group, rank order)."""
    if shard.shape[0] != layout.shard_tokens:
        raise ValueError(f"stage {layout.index}: expected a {layout.shard_tokens}-row shard, got {shard.shape[0]}")
    parts = all_gather(shard.contiguous())
    if len(parts) != layout.tp_size:
        raise ValueError(f"all_gather returned {len(parts)} shards for tp_size {layout.tp_size}")
    import torch  # here, not at import: the planner and launcher use this module without tensors

    return torch.cat(parts)


# ---------------------------------------------------------------------- log


def layout_line(who: str, step: int, layout: StageLayout, *, split: str, why: str = "") -> str:
    """One ``AFD_MRV2_LAYOUT_LOG`` line: shapes and counts of one stage of one step."""
    s = layout
    policy = f"{split} split" if s.split else f"unsplit ({why or 'no plan'})"
    return (
        f"afd-mrv2 layout: {who} step {step} stage {s.index + 1}/{s.num_stages} {policy}, {s.layout} layout x tp {s.tp_size}: "
        f"real {s.real_tokens} + dp padding {s.dp_padding} + tp padding {s.tp_padding} = {s.physical_tokens} rows, "
        f"shard rows {s.shard.start}..{s.shard.stop - 1} of tp rank {s.tp_rank}"
    )
