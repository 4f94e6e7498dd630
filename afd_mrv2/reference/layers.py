"""The reference model's building blocks, shared by the ground truth and the AFD run.

Both paths call these same functions, so a difference between them measures the
disaggregation (transport, routing, combine order, pipelining), not two
implementations of the math.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.weights import LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def self_attention(x: torch.Tensor, w: LayerWeights, num_heads: int, lengths: Sequence[int]) -> torch.Tensor:
    """Causal multi-head attention over each request of ``x`` ([T, H], requests back to back)."""
    tokens, hidden = x.shape
    head = hidden // num_heads
    q, k, v = (x @ w.wq.T, x @ w.wk.T, x @ w.wv.T)
    out = torch.empty_like(x)
    start = 0
    for length in lengths:
        end = start + length

        def heads(t: torch.Tensor, a: int = start, b: int = end) -> torch.Tensor:
            return t[a:b].view(b - a, num_heads, head).transpose(0, 1)

        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        out[start:end] = o.transpose(0, 1).reshape(length, hidden)
        start = end
    if start != tokens:
        raise ValueError(f"request lengths sum to {start}, but the stage has {tokens} tokens")
    return out @ w.wo.T


def route(x: torch.Tensor, w: LayerWeights, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: softmax of the gate logits (with the spec's hot bias / blocked experts).

    Returns (topk_ids [T, k] int64, topk_weights [T, k] fp32), highest weight first;
    like DeepSeek-V2, the top-k weights are not renormalised.
    """
    logits = x @ w.gate.T
    if spec.hot_expert is not None:
        logits[:, spec.hot_expert] += spec.hot_bias
    if spec.blocked_experts:
        logits[:, list(spec.blocked_experts)] = float("-inf")
    weights, ids = torch.topk(logits.softmax(dim=-1), spec.top_k, dim=-1)
    return ids, weights


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.T


def moe_partial(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: LayerWeights,
    experts: range,
    shared_rows: torch.Tensor | None,
) -> torch.Tensor:
    """The MoE output of ``experts`` for ``x``, plus the shared expert for ``shared_rows``.

    ``shared_rows`` is a boolean mask over the rows that get the shared expert
    here (None: all rows).  With every expert and every row this is the full MoE
    layer; an FFN rank computes its own experts and the shared expert of the
    tokens whose top-1 expert it owns, and the attention side sums the partials.
    """
    if shared_rows is None:
        out = swiglu(x, w.shared_w13, w.shared_w2)
    else:
        out = torch.zeros_like(x)
        rows = shared_rows.nonzero().squeeze(1)
        if rows.numel():
            out.index_copy_(0, rows, swiglu(x.index_select(0, rows), w.shared_w13, w.shared_w2))
    for expert in experts:
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y = swiglu(x.index_select(0, token), w.experts_w13[expert], w.experts_w2[expert])
        out.index_add_(0, token, y * topk_weights[token, slot].unsqueeze(1))
    return out
