"""A tiny deterministic MoE, split the AFD way: attention + gate on one side, experts on the other (:class:`ToyMoE`).

See docs/internals/cam-connectors.md, "afd_mrv2.probe.toy".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from afd_mrv2.hooks.cam.camasync_state import CamAsyncDispatch, CamAsyncFfnBatch, CamAsyncFfnOutput
from afd_mrv2.hooks.cam.common import CamModelSpec
from afd_mrv2.items import WorkItem


@dataclass(frozen=True)
class ToyMoE:
    attn: torch.Tensor  # (L, H, H)
    gate: torch.Tensor  # (L, H, E)
    gate_bias: torch.Tensor  # (L, E)
    experts: torch.Tensor  # (L, E, H, H)
    shared: torch.Tensor  # (L, H, H)
    topk: int

    @classmethod
    def build(
        cls,
        *,
        hidden: int = 16,
        num_experts: int = 8,
        topk: int = 2,
        num_layers: int = 4,
        seed: int = 0,
        starve: Mapping[int, tuple[int, int]] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ToyMoE:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / float(hidden**0.5)).to(dtype)

        bias = torch.zeros(num_layers, num_experts)
        for layer, (lo, hi) in (starve or {}).items():
            bias[layer, lo:hi] = -1e4
        return cls(
            w(num_layers, hidden, hidden),
            w(num_layers, hidden, num_experts),
            bias.to(dtype),
            w(num_layers, num_experts, hidden, hidden),
            w(num_layers, hidden, hidden),
            topk,
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ToyMoE:
        """A copy on ``device`` (and ``dtype``): the NPU probe runs the same model on the NPU in bf16."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype or t.dtype)

        return ToyMoE(
            move(self.attn), move(self.gate), move(self.gate_bias), move(self.experts), move(self.shared), self.topk
        )

    @property
    def spec(self) -> CamModelSpec:
        layers, experts, hidden = self.gate.shape[0], self.gate.shape[2], self.gate.shape[1]
        return CamModelSpec(hidden, self.topk, experts, layers, self.attn.dtype)

    def embed(self, rank: int, tokens: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        return torch.randn(tokens, self.spec.hidden_size, generator=g).to(
            device=self.attn.device, dtype=self.attn.dtype
        )

    def attention(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(h @ self.attn[layer])

    def route(self, layer: int, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (a @ self.gate[layer] + self.gate_bias[layer]).to(torch.float32)
        top, ids = torch.topk(logits, self.topk, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def expert(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.experts[layer, expert])

    def shared_expert(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.shared[layer]) / 2

    def moe(self, layer: int, a: torch.Tensor) -> torch.Tensor:
        """The whole MoE of one layer on one rank (the CAMP2P FFN computes this)."""
        ids, weights = self.route(layer, a)
        out = self.shared_expert(layer, a).to(torch.float32)  # same device as a
        for k in range(self.topk):
            for e in ids[:, k].unique().tolist():
                rows = ids[:, k] == e
                out[rows] += weights[rows, k : k + 1] * self.expert(layer, e, a[rows]).to(torch.float32)
        return out.to(a.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The unsplit reference."""
        for layer in range(self.spec.num_layers):
            a = self.attention(layer, h)
            h = a + self.moe(layer, a)
        return h


class ToyAttention:
    """The attention role's ``compute`` for work item (L, s): see :mod:`afd_mrv2.stages.pairing`."""

    def __init__(self, model: ToyMoE, *, dispatch_routing: bool) -> None:
        self.model = model
        self.dispatch_routing = dispatch_routing
        self.residual: dict[int, torch.Tensor] = {}

    def __call__(self, item: WorkItem, inputs: torch.Tensor) -> object:
        layer, stage = item.layer_idx, item.stage_idx
        h = inputs if layer == 0 else self.residual[stage] + inputs
        if layer == self.model.spec.num_layers:
            return h
        a = self.model.attention(layer, h)
        self.residual[stage] = a
        if not self.dispatch_routing:
            return a
        ids, weights = self.model.route(layer, a)
        return CamAsyncDispatch(a, ids, weights)


def camp2p_ffn(model: ToyMoE) -> Callable[[WorkItem, torch.Tensor], torch.Tensor]:
    """CAMP2P FFN ``compute``: gate and experts on the FFN side."""

    def compute(item: WorkItem, hidden: torch.Tensor) -> torch.Tensor:
        return model.moe(item.layer_idx, hidden) if hidden.shape[0] else hidden.clone()

    return compute


def camasync_ffn(
    model: ToyMoE, ffn_rank: int, experts_per_rank: int
) -> Callable[[WorkItem, CamAsyncFfnBatch], CamAsyncFfnOutput]:
    """CAMAsync FFN ``compute``: this rank's experts over rows grouped by local expert, plus the shared expert."""

    def compute(item: WorkItem, batch: CamAsyncFfnBatch) -> CamAsyncFfnOutput:
        if batch.layer_idx != item.layer_idx:
            raise AssertionError(f"payload of layer {batch.layer_idx} handed to work item {item}")
        batch = batch.dequantized(model.attn.dtype)  # dynamicQuant: int8 rows and their scales, dequantized here
        x, routed, row = batch.hidden_states, torch.empty_like(batch.hidden_states), 0
        for local, count in enumerate(batch.group_list.tolist()):
            if count:
                routed[row : row + count] = model.expert(
                    batch.layer_idx, ffn_rank * experts_per_rank + local, x[row : row + count]
                )
            row += count
        shared = batch.shared_hidden_states
        return CamAsyncFfnOutput(routed, model.shared_expert(batch.layer_idx, shared) if shared.shape[0] else None)

    return compute
