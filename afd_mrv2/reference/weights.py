"""Seeded weights of the reference model: same seed, same tensors, in every process."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_mrv2.reference.spec import ModelSpec


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    wq: torch.Tensor  # [H, H]
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor  # [H]
    gate: torch.Tensor  # [E, H]
    experts_w13: torch.Tensor  # [E, 2 * I, H]: gate and up projections of each routed expert
    experts_w2: torch.Tensor  # [E, H, I]: down projection
    shared_w13: torch.Tensor  # [2 * S, H]
    shared_w2: torch.Tensor  # [H, S]


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H]


def build_weights(spec: ModelSpec) -> Weights:
    """Draw every tensor from one generator seeded with ``spec.seed``, in a fixed order.

    Scales keep activations O(1) through the layers (unit-RMS inputs, gate logits
    of standard deviation ~1), so fp32 round-off stays far below the 1e-5
    tolerance the end-to-end checks use.
    """
    g = torch.Generator().manual_seed(spec.seed)
    h, e, i, s = spec.hidden_size, spec.num_experts, spec.expert_size, spec.shared_size

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 1.0 + normal(h, std=0.1)

    embed = normal(spec.vocab_size, h, std=1.0)
    layers = []
    for _ in range(spec.num_layers):
        layers.append(
            LayerWeights(
                attn_norm=norm(),
                wq=normal(h, h, std=h**-0.5),
                wk=normal(h, h, std=h**-0.5),
                wv=normal(h, h, std=h**-0.5),
                wo=normal(h, h, std=0.5 * h**-0.5),
                ffn_norm=norm(),
                gate=normal(e, h, std=h**-0.5),
                experts_w13=normal(e, 2 * i, h, std=h**-0.5),
                experts_w2=normal(e, h, i, std=0.5 * i**-0.5),
                shared_w13=normal(2 * s, h, std=h**-0.5),
                shared_w2=normal(h, s, std=0.5 * s**-0.5),
            )
        )
    return Weights(embed=embed, layers=tuple(layers), final_norm=norm())
