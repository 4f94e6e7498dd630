"""The attention ranks' split-step collectives of ``afd-mrv2 run --async-moe-split``.

The process groups (every attention rank; the TP group of each attention DP
rank), the all-gather the TP layouts use, the per-batch split/unsplit decision
(:func:`afd_mrv2.stages.layout.decide_split`, one all-gather per batch) and the
``AFD_MRV2_LAYOUT_LOG`` writer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from afd_mrv2.reference.batches import concat, make_batch
from afd_mrv2.reference.runconfig import RunConfig
from afd_mrv2.stages import plan_stages
from afd_mrv2.stages.layout import StepDecision, decide_split
from afd_mrv2.topology import ATTENTION


def layout_log(line: str) -> None:
    """An ``AFD_MRV2_LAYOUT_LOG`` line on stderr, in one write (see :func:`progress`)."""
    sys.stderr.flush()
    os.write(2, f"{line}\n".encode("utf-8", "replace"))


def groups(cfg: RunConfig) -> tuple[list[Any], Any]:
    """(TP group of each attention DP rank or [], the attention ranks' group or None); every rank calls this."""
    if not cfg.async_moe_split:
        return [], None
    tp, procs = cfg.attention_tp, cfg.attention_processes
    attention = dist.new_group(list(range(procs)))
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(cfg.num_attention)] if tp > 1 else []
    return tp_groups, attention


def all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def decide_batches(
    cfg: RunConfig, vocab_size: int, batches: range, role: str, attention_group: Any
) -> dict[int, StepDecision]:
    """Split or unsplit, per batch, decided together by the attention ranks (one all-gather per batch).

    An FFN rank takes no part in the attention ranks' collective: it derives the
    same decisions from the seeded batch schedule (every rank can draw every
    DP rank's batch lengths) and torch_p2p checks, in every header, that each
    attention rank's stage count is the one it expects.
    """
    if not cfg.async_moe_split:
        return {}
    split = cfg.async_moe_split

    def row(dp: int, b: int) -> list[int]:
        lengths = concat(make_batch(cfg.batch_spec_for(dp, b), vocab_size, dp, b)).lengths
        return [int(plan_stages(lengths, split=split) is not None), sum(lengths), len(lengths)]

    def name_of(process: int) -> str:
        return f"attention DP rank {process // cfg.attention_tp}"

    out = {}
    for b in batches:
        if role == ATTENTION:
            mine = row(dist.get_rank(attention_group) // cfg.attention_tp, b)

            def exchange(values: Any) -> list[list[int]]:
                return [p.tolist() for p in all_gather(torch.tensor(values, dtype=torch.int64), attention_group)]

            out[b] = decide_split(bool(mine[0]), mine[1], mine[2], exchange, name_of=name_of)
        else:
            rows = [row(p // cfg.attention_tp, b) for p in range(cfg.attention_processes)]

            def derived(_values: Sequence[int], rows: list[list[int]] = rows) -> list[list[int]]:
                return rows

            out[b] = decide_split(bool(rows[0][0]), rows[0][1], rows[0][2], derived, name_of=name_of)
    return out
