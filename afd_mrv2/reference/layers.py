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


def project_qkv(x: torch.Tensor, w: LayerWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value projections of ``x`` [T, H] (no rotary embedding in this model)."""
    return x @ w.wq.T, x @ w.wk.T, x @ w.wv.T


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, context: int = 0) -> torch.Tensor:
    """Causal attention of ONE request: query rows ``q`` [Q, H] over its keys/values ``k``, ``v`` [context + Q, H].

    Query row ``i`` sits at position ``context + i`` and sees keys ``0..context + i``.
    ``context == 0`` is the whole-request case (``is_causal``); ``context > 0`` is a
    chunked-prefill continuation whose first ``context`` keys come from the KV cache.
    """
    queries, hidden = q.shape
    if k.shape[0] != context + queries or v.shape[0] != k.shape[0]:
        raise ValueError(
            f"attend: expected {context + queries} keys/values (context {context} + {queries} queries), got {k.shape[0]}/{v.shape[0]}"
        )
    head = hidden // num_heads

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], num_heads, head).transpose(0, 1)

    if context == 0:
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    else:
        mask = torch.arange(context + queries)[None, :] <= (context + torch.arange(queries))[:, None]
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
    return o.transpose(0, 1).reshape(queries, hidden)


def self_attention(x: torch.Tensor, w: LayerWeights, num_heads: int, lengths: Sequence[int]) -> torch.Tensor:
    """Causal multi-head attention over each request of ``x`` ([T, H], requests back to back)."""
    tokens = x.shape[0]
    q, k, v = project_qkv(x, w)
    out = torch.empty_like(x)
    start = 0
    for length in lengths:
        end = start + length
        out[start:end] = attend(q[start:end], k[start:end], v[start:end], num_heads)
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
