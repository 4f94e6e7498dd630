"""Attention-rank compute under ``--async-moe-split``: the planner's stages, their layouts and the fallback.

:class:`SplitAttentionOwner`.

See docs/internals/async-moe-stages.md, "afd_mrv2.reference.split_owner".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from afd_mrv2.reference.batches import concat
from afd_mrv2.reference.forward import embed, moe_input
from afd_mrv2.reference.kvcache import KvCache
from afd_mrv2.reference.owners import AttentionOwner
from afd_mrv2.reference.staged import SplitBatch, new_cache, plan_batch, staged_attention
from afd_mrv2.stages import merge_tokens
from afd_mrv2.stages.layout import (
    StageLayout,
    StepDecision,
    decide_split,
    gather_shards,
    layout_line,
    pad_rows,
    round_up,
    step_layouts,
    take_shard,
    unsplit_stage,
)

#: ``all_gather(shard) -> every TP rank's shard, in TP rank order`` (a collective over the TP group).
TpGather = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass
class SplitAttentionOwner(AttentionOwner):
    """See docs/internals/async-moe-stages.md.

    ``decisions``: the DP group's decision per batch (from the per-step
    collective); a batch missing there is decided by this rank alone.
    ``log``: called with one :func:`~afd_mrv2.stages.layout.layout_line` per
    stage when a step starts (``AFD_MRV2_LAYOUT_LOG``), or None.
    """

    split: str = "token"
    layout: str = "tp"
    tp_size: int = 1
    tp_rank: int = 0
    tp_gather: TpGather | None = None
    decisions: dict[int, StepDecision] = field(default_factory=dict)
    name: str = "attention rank"
    log: Callable[[str], None] | None = None
    plans: dict[int, SplitBatch] = field(init=False)
    layouts: dict[int, list[StageLayout]] = field(init=False)
    tokens: dict[int, torch.Tensor] = field(init=False)
    _caches: dict[int, KvCache] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp_size > 1 and self.tp_gather is None:
            raise ValueError(f"tp_size {self.tp_size} needs tp_gather (an all-gather over the TP group)")
        self.plans, self.layouts, self.tokens = {}, {}, {}
        for batch, stages in self.batches.items():
            whole = concat(stages)
            plan = self._plan(batch, whole.lengths)
            if len(plan.stages) != self.schedule.stages_of(batch):
                raise ValueError(
                    f"batch {batch}: the plan has {len(plan.stages)} stage(s), the schedule "
                    f"{self.schedule.stages_of(batch)}: the schedule must come from the same decisions"
                )
            self.plans[batch], self.tokens[batch] = plan, whole.tokens

    def _plan(self, batch: int, lengths: tuple[int, ...]) -> SplitBatch:
        sp = self.layout == "sp"
        planned = plan_batch(lengths, split=self.split, tp_size=self.tp_size, sequence_parallel=sp, seed=batch)
        decision = self.decisions.get(batch) or decide_split(planned is not None, sum(lengths), len(lengths))
        self.decisions[batch] = decision
        if decision.split:
            if planned is None:
                raise ValueError(f"batch {batch}: the group decided to split, but this rank has no plan")
            plan: SplitBatch | None = planned
        else:
            rows = round_up(decision.dp_max_tokens, self.tp_size) if sp else decision.dp_max_tokens
            plan = plan_batch(lengths, split=self.split, seed=batch, unsplit=(rows, decision.why))
        assert plan is not None
        self.layouts[batch] = step_layouts(
            plan.stages,
            dp_max_tokens=decision.dp_max_tokens,
            layout=self.layout,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
        )
        return plan

    # ------------------------------------------------------------------ rows

    def _gather(self, shard: torch.Tensor, layout: StageLayout) -> torch.Tensor:
        if self.tp_size == 1:
            return shard
        assert self.tp_gather is not None
        return gather_shards(shard, layout, self.tp_gather)

    def _embed(self, batch: int, stage: int) -> torch.Tensor:
        plan, layout = self.plans[batch], self.layouts[batch][stage]
        if stage == 0:
            self._caches[batch] = new_cache(self.spec, plan)
            if self.log is not None:
                for s in self.layouts[batch]:
                    self.log(layout_line(self.name, batch, s, split=self.split, why=plan.unsplit_why))
        token_slice = plan.stages[stage].token_slice
        if self.layout == "tp":  # replicated: the stage's real rows (+ the parent's DP padding when unsplit)
            return pad_rows(embed(self.weights, self.tokens[batch][token_slice]), plan.stages[stage].num_input_tokens)
        # sp: this rank's shard of the parent batch, converted into its shard of the stage
        parent = self._parent_layout(batch)
        parent_shard = take_shard(pad_rows(embed(self.weights, self.tokens[batch]), parent.physical_tokens), parent)
        parent_rows = self._gather(parent_shard, parent)
        return take_shard(pad_rows(parent_rows[token_slice], layout.physical_tokens), layout)

    def _parent_layout(self, batch: int) -> StageLayout:
        """The parent batch as one stage: its SP shards before the split and after the restore."""
        layouts = self.layouts[batch]
        if len(layouts) == 1:
            return layouts[0]
        (parent,) = step_layouts(
            [unsplit_stage(self.plans[batch].lengths)],
            dp_max_tokens=self.decisions[batch].dp_max_tokens,
            layout=self.layout,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
        )
        return parent

    def _attention(
        self, batch: int, stage: int, layer: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        plan, layout, cache = self.plans[batch], self.layouts[batch][stage], self._caches[batch]
        if self.layout == "tp":
            h = staged_attention(self.weights, self.spec, layer, h, plan, stage, cache)
            # the CAM boundary: pad to a multiple of tp_size, dispatch this rank's shard
            x, ids, weights = moe_input(self.weights, self.spec, layer, pad_rows(h, layout.physical_tokens))
            return h, take_shard(x, layout), take_shard(ids, layout), take_shard(weights, layout)
        rows = staged_attention(self.weights, self.spec, layer, self._gather(h, layout), plan, stage, cache)
        h = take_shard(rows, layout)
        return (h, *moe_input(self.weights, self.spec, layer, h))

    def _combine(self, batch: int, stage: int, residual: torch.Tensor, combined: torch.Tensor) -> torch.Tensor:
        if self.layout == "tp":  # all-gather the shards' FFN output, drop the CAM padding
            layout = self.layouts[batch][stage]
            return residual + self._gather(combined, layout)[: residual.shape[0]]
        return residual + combined

    def _finished(self, batch: int, stage: int) -> None:
        if stage == len(self.plans[batch].stages) - 1:
            self._caches.pop(batch, None)

    # ------------------------------------------------------------------ results

    def output(self, batch: int) -> torch.Tensor:
        """The batch's final hidden states, real tokens in order (gathered over the TP group under SP)."""
        plan = self.plans[batch]
        stages = [self.outputs[(batch, s)] for s in range(len(plan.stages))]
        if self.layout == "sp":
            stages = [self._gather(rows, layout) for rows, layout in zip(stages, self.layouts[batch], strict=True)]
        return merge_tokens(stages, plan.stages)

    def parent_shard(self, batch: int) -> torch.Tensor:
        """Under SP: the final hidden states restored to the parent batch's layout, this rank's shard."""
        parent = self._parent_layout(batch)
        return take_shard(pad_rows(self.output(batch), parent.physical_tokens), parent)
