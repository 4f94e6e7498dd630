"""The compute functions each AFD role hands to its executor, and the work-item order.

Both roles number work items the same way (torch_p2p checks it in every header)::

    seq(batch, layer, stage) = (batch * (L + 1) + layer) * S + stage

and submit them batch by batch, layer by layer, stage by stage.  The attention
role has one more layer per batch, the epilogue ``layer == L``, which only adds
the last FFN output and applies the final norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from afd_mrv2.hooks.quant import dequantize_per_token
from afd_mrv2.items import WorkItem
from afd_mrv2.reference.batches import StageBatch
from afd_mrv2.reference.forward import attention_step, embed, final_norm
from afd_mrv2.reference.layers import moe_partial
from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.weights import Weights
from afd_mrv2.topology import ATTENTION, Topology


@dataclass(frozen=True)
class Schedule:
    """Work-item numbering: ``stages`` per batch, or ``per_batch[batch]`` where a batch differs.

    A batch the async-MoE planner could not split (the rank-consistent fallback,
    :func:`afd_mrv2.stages.layout.decide_split`) runs as one stage while its
    neighbours run two: ``seq`` then counts on across batches of different stage
    counts, and every item carries its batch's stage count (``num_stages``),
    which torch_p2p sends in every header.
    """

    num_layers: int
    stages: int
    per_batch: Mapping[int, int] = field(default_factory=dict)

    def stages_of(self, batch: int) -> int:
        return self.per_batch.get(batch, self.stages)

    def _first_seq(self, batch: int) -> int:
        return sum((self.num_layers + 1) * self.stages_of(b) for b in range(batch))

    def seq(self, batch: int, layer: int, stage: int) -> int:
        return self._first_seq(batch) + layer * self.stages_of(batch) + stage

    def batch_of(self, item: WorkItem) -> int:
        batch, start = 0, 0
        while item.seq >= start + (self.num_layers + 1) * self.stages_of(batch):
            start += (self.num_layers + 1) * self.stages_of(batch)
            batch += 1
        return batch

    def items(self, role: str, batches: Iterable[int]) -> Iterator[WorkItem]:
        layers = self.num_layers + 1 if role == ATTENTION else self.num_layers
        for batch in batches:
            stages = self.stages_of(batch)
            for layer in range(layers):
                for stage in range(stages):
                    yield WorkItem(layer, stage, self.seq(batch, layer, stage), num_stages=stages)


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
            h = self._combine(batch, item.stage_idx, self._residual.pop(key), combined)
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

    def _combine(self, batch: int, stage: int, residual: torch.Tensor, combined: torch.Tensor) -> torch.Tensor:
        """The residual after the previous layer's MoE: ``combined`` is the summed FFN output of this rank's rows."""
        return residual + combined

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
        self,
        item: WorkItem,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """torch_p2p's FFN compute; with ``scales`` (``quant: w8a8``) ``hidden`` is int8, dequantized here."""
        self.tokens += hidden.shape[0]
        self.calls += 1
        if scales is not None:
            hidden = dequantize_per_token(hidden, scales)
        experts = self.topology.experts_of(self.ffn_index)
        top1_here = (topk_ids[:, 0] >= experts.start) & (topk_ids[:, 0] < experts.stop)
        return moe_partial(hidden, topk_ids, topk_weights, self.weights.layers[item.layer_idx], experts, top1_here)
