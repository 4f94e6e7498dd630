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

from afd_mrv2.pipeline.work import WorkItem
from afd_mrv2.reference.batches import Stage
from afd_mrv2.reference.forward import attention_step, embed, final_norm
from afd_mrv2.reference.layers import moe_partial
from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.weights import Weights
from afd_mrv2.topology import ATTENTION, Topology


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
    batches: dict[int, list[Stage]]
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
        stage = self.batches[batch][item.stage_idx]
        if item.layer_idx == 0:
            h = embed(self.weights, stage.tokens)
        else:
            if combined is None:
                raise ValueError(f"attention compute for {item}: the FFN output of the previous layer is missing")
            h = self._residual.pop(key) + combined
        if item.layer_idx == self.spec.num_layers:
            self.outputs[key] = final_norm(self.weights, self.spec, h)
            return None
        h, x, ids, topk_weights = attention_step(self.weights, self.spec, item.layer_idx, h, stage.lengths)
        self._residual[key] = h
        self.expert_tokens += torch.bincount(ids.flatten(), minlength=self.spec.num_experts)
        self.routed_tokens += ids.shape[0]
        return x, ids, topk_weights


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
