"""The compute functions each AFD role hands to its executor, and the work-item order.

Both roles number work items the same way (torch_p2p checks it in every header)::

    seq(batch, layer, stage) = (batch * (L + 1) + layer) * S + stage

and submit them batch by batch, layer by layer, stage by stage.  The attention
role has one more layer per batch, the epilogue ``layer == L``, which only adds
the last FFN output and applies the final norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from afd_mrv2.items import WorkItem
from afd_mrv2.reference.batches import StageBatch, concat
from afd_mrv2.reference.forward import attention_step, embed, final_norm
from afd_mrv2.reference.kvcache import KvCache
from afd_mrv2.reference.layers import moe_partial
from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.staged import SplitBatch, new_cache, plan_batch, staged_attention_step
from afd_mrv2.reference.weights import Weights
from afd_mrv2.topology import ATTENTION, Topology
from afd_mrv2.ubatch import NUM_STAGES, merge_tokens, split_tokens


@dataclass(frozen=True)
class Schedule:
    num_layers: int
    stages: int

    def seq(self, batch: int, layer: int, stage: int) -> int:
        return (batch * (self.num_layers + 1) + layer) * self.stages + stage

    def batch_of(self, item: WorkItem) -> int:
        return item.seq // ((self.num_layers + 1) * self.stages)

    def items(self, role: str, batches: Iterable[int]) -> Iterator[WorkItem]:
        layers = self.num_layers + 1 if role == ATTENTION else self.num_layers
        for batch in batches:
            for layer in range(layers):
                for stage in range(self.stages):
                    yield WorkItem(layer, stage, self.seq(batch, layer, stage))


@dataclass
class AttentionOwner:
    """Attention-rank compute: embedding, attention + router per layer, final norm.

    ``compute(item, combined)`` follows torch_p2p's attention contract: it adds the
    summed FFN output of the previous layer to the residual of (batch, stage),
    then returns the MoE input and routing of this layer, or None (and stores the
    final hidden states) for the epilogue.
    """

    spec: ModelSpec
    weights: Weights
    schedule: Schedule
    batches: dict[int, list[StageBatch]]
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    expert_tokens: torch.Tensor = field(init=False)  # [E]: tokens that selected each expert
    routed_tokens: int = 0
    _residual: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.expert_tokens = torch.zeros(self.spec.num_experts, dtype=torch.int64)

    def compute(
        self, item: WorkItem, combined: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        batch = self.schedule.batch_of(item)
        key = (batch, item.stage_idx)
        if item.layer_idx == 0:
            h = self._embed(batch, item.stage_idx)
        else:
            if combined is None:
                raise ValueError(f"attention compute for {item}: the FFN output of the previous layer is missing")
            h = self._residual.pop(key) + combined
        if item.layer_idx == self.spec.num_layers:
            self.outputs[key] = final_norm(self.weights, self.spec, h)
            self._finished(batch, item.stage_idx)
            return None
        h, x, ids, topk_weights = self._attention(batch, item.stage_idx, item.layer_idx, h)
        self._residual[key] = h
        self.expert_tokens += torch.bincount(ids.flatten(), minlength=self.spec.num_experts)
        self.routed_tokens += ids.shape[0]
        return x, ids, topk_weights

    def _embed(self, batch: int, stage: int) -> torch.Tensor:
        return embed(self.weights, self.batches[batch][stage].tokens)

    def _attention(
        self, batch: int, stage: int, layer: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return attention_step(self.weights, self.spec, layer, h, self.batches[batch][stage].lengths)

    def _finished(self, batch: int, stage: int) -> None:
        """The epilogue of (batch, stage) ran."""

    def output(self, batch: int) -> torch.Tensor:
        """Final hidden states of the whole batch, its stages back in token order."""
        return torch.cat([self.outputs[(batch, s)] for s in range(self.schedule.stages)])


@dataclass
class SplitAttentionOwner(AttentionOwner):
    """Attention-rank compute under ``--async-moe-split``: each batch planned into the planner's two stages.

    ``batches`` holds each batch's requests (any grouping; they are concatenated)
    and ``split`` the policy (``token`` or ``request``).  Stage ``s`` of a batch
    runs :func:`~afd_mrv2.reference.staged.staged_attention_step` over the batch's
    KV cache (created by stage 0 of layer 0, dropped after the last epilogue), so
    a request the ``token`` split cuts continues in stage 2 with its stage-1
    tokens as KV context.  Work items are computed in (layer, stage) order on one
    compute stream, so stage 1 of layer l always wrote its K/V before stage 2 of
    layer l reads them (the cache raises if not).
    """

    split: str = "token"
    plans: dict[int, SplitBatch] = field(init=False)
    tokens: dict[int, torch.Tensor] = field(init=False)
    _caches: dict[int, KvCache] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.schedule.stages != NUM_STAGES:
            raise ValueError(
                f"the async-MoE split runs {NUM_STAGES} stages per batch, the schedule has {self.schedule.stages}"
            )
        self.plans, self.tokens = {}, {}
        for batch, stages in self.batches.items():
            whole = concat(stages)
            plan = plan_batch(whole.lengths, split=self.split, seed=batch)
            if plan is None:
                raise ValueError(
                    f"batch {batch}: the {self.split} split cannot form two stages from requests of {list(whole.lengths)} tokens "
                    "(request: needs 2+ requests; token: needs 2+ tokens)"
                )
            self.plans[batch], self.tokens[batch] = plan, whole.tokens

    def _embed(self, batch: int, stage: int) -> torch.Tensor:
        if stage == 0:
            self._caches[batch] = new_cache(self.spec, self.plans[batch])
        return split_tokens(embed(self.weights, self.tokens[batch]), [self.plans[batch].stages[stage]])[0]

    def _attention(
        self, batch: int, stage: int, layer: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = self._caches[batch]
        return staged_attention_step(self.weights, self.spec, layer, h, self.plans[batch], stage, cache)

    def _finished(self, batch: int, stage: int) -> None:
        if stage == NUM_STAGES - 1:
            self._caches.pop(batch, None)

    def output(self, batch: int) -> torch.Tensor:
        plan = self.plans[batch]
        return merge_tokens([self.outputs[(batch, s)] for s in range(NUM_STAGES)], plan.stages)


@dataclass
class FfnOwner:
    """FFN-rank compute: this rank's routed experts, and the shared expert of the
    tokens whose top-1 expert lives here (see :mod:`afd_mrv2.topology`)."""

    spec: ModelSpec
    weights: Weights
    topology: Topology
    ffn_index: int
    tokens: int = 0
    calls: int = 0

    def compute(
        self, item: WorkItem, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        self.tokens += hidden.shape[0]
        self.calls += 1
        experts = self.topology.experts_of(self.ffn_index)
        top1_here = (topk_ids[:, 0] >= experts.start) & (topk_ids[:, 0] < experts.stop)
        return moe_partial(hidden, topk_ids, topk_weights, self.weights.layers[item.layer_idx], experts, top1_here)
