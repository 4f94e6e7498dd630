"""The reference forward: one process, whole model, the ground truth of every AFD run.

The attention-side step is factored out (:func:`attention_step`) because the AFD
run's attention ranks execute exactly it, while the MoE half is executed by the
FFN ranks through :func:`~afd_mrv2.reference.layers.moe_partial` on their
experts and summed back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afd_mrv2.reference.layers import moe_partial, rms_norm, route, self_attention
from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.weights import Weights


def embed(weights: Weights, tokens: torch.Tensor) -> torch.Tensor:
    return weights.embed.index_select(0, tokens)


def attention_step(
    weights: Weights, spec: ModelSpec, layer: int, h: torch.Tensor, lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s attention half: returns (residual, MoE input, topk_ids, topk_weights)."""
    w = weights.layers[layer]
    h = h + self_attention(rms_norm(h, w.attn_norm, spec.rms_eps), w, spec.num_heads, lengths)
    return (h, *moe_input(weights, spec, layer, h))


def moe_input(
    weights: Weights, spec: ModelSpec, layer: int, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After attention: the MoE input (normed residual) and its routing (x, topk_ids, topk_weights)."""
    w = weights.layers[layer]
    x = rms_norm(h, w.ffn_norm, spec.rms_eps)
    ids, topk_weights = route(x, w, spec)
    return x, ids, topk_weights


def final_norm(weights: Weights, spec: ModelSpec, h: torch.Tensor) -> torch.Tensor:
    return rms_norm(h, weights.final_norm, spec.rms_eps)


def reference_forward(weights: Weights, spec: ModelSpec, tokens: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Final hidden states [T, H] of ``tokens`` (requests of ``lengths`` back to back)."""
    everything = range(spec.num_experts)
    h = embed(weights, tokens)
    for layer in range(spec.num_layers):
        h, x, ids, topk_weights = attention_step(weights, spec, layer, h, lengths)
        h = h + moe_partial(x, ids, topk_weights, weights.layers[layer], everything, None)
    return final_norm(weights, spec, h)
