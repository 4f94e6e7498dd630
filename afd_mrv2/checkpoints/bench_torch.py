"""The torch emulation of one layer's compute on each side, for :func:`afd_mrv2.checkpoints.bench.measure_layer_compute`.

``--kernels torch`` (and ``auto`` without vLLM): the Attention engine's and the FFN's
work per MoE layer written in torch ops, the shapes and weight reads of the layers vLLM
runs (docs/internals/reference.md, "afd_mrv2.checkpoints.bench", says what each side
covers); :mod:`afd_mrv2.checkpoints.bench_vllm` is the same with vLLM's CPU kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afd_mrv2.checkpoints.archs import HEAD_DIM, MLA_KV_LORA_RANK, MLA_NOPE_DIM, MLA_ROPE_DIM, MLA_V_DIM, ModelShape

EPS = 1e-6


def _randn(generator: torch.Generator, std: float, *dims: int) -> torch.Tensor:
    return torch.randn(*dims, generator=generator) * std


def add_rms(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused residual add + RMSNorm: returns (normed, new residual)."""
    residual = x + residual
    variance = residual.pow(2).mean(-1, keepdim=True)
    return residual * torch.rsqrt(variance + EPS) * weight, residual


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of ``x`` [tokens, heads, rot] with ``cos``/``sin`` [tokens, 1, rot/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchAttentionSide:
    """The Attention engine's work per MoE layer, for every layer of a shape (see the module docstring)."""

    def __init__(self, shape: ModelShape, contexts: torch.Tensor, g: torch.Generator) -> None:
        self.shape = shape
        seqs, h = contexts.numel(), shape.hidden
        self.mla = shape.arch == "deepseek_v2"
        rot = MLA_ROPE_DIM if self.mla else HEAD_DIM
        longest = int(contexts.max())
        self.positions = contexts - 1  # the new token's position = where its key/value goes
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        angles = torch.outer(torch.arange(longest, dtype=torch.float32), inv_freq)
        self.cos_cache, self.sin_cache = angles.cos(), angles.sin()  # vLLM's cos_sin_cache, gathered per call
        # [seqs, 1, 1, longest]: True where a sequence's context has a key (its own length)
        self.mask = (torch.arange(longest)[None, :] < contexts[:, None])[:, None, None, :]
        self.rows = torch.arange(seqs)
        self.x = _randn(g, 1.0, seqs, h)
        self.residual = _randn(g, 1.0, seqs, h)
        self.layers = [self._layer_weights(g, seqs, longest) for _ in range(shape.layers)]

    def _layer_weights(self, g: torch.Generator, seqs: int, longest: int) -> dict[str, torch.Tensor]:
        s = self.shape
        h, heads, inter, std = s.hidden, s.heads, s.intermediate, s.std
        w: dict[str, torch.Tensor] = {
            "in_norm": torch.ones(h),
            "post_norm": torch.ones(h),
            "gate": _randn(g, std, s.experts, h),
        }
        if self.mla:
            w["q"] = _randn(g, std, heads * (MLA_NOPE_DIM + MLA_ROPE_DIM), h)
            w["kv_a"] = _randn(g, std, MLA_KV_LORA_RANK + MLA_ROPE_DIM, h)
            w["kv_a_norm"] = torch.ones(MLA_KV_LORA_RANK)
            w["w_uk"] = _randn(g, std, heads, MLA_NOPE_DIM, MLA_KV_LORA_RANK)  # kv_b_proj's key part, absorbed
            w["w_uv"] = _randn(g, std, heads, MLA_KV_LORA_RANK, MLA_V_DIM)  # kv_b_proj's value part, absorbed
            w["o"] = _randn(g, std, h, heads * MLA_V_DIM)
            w["latent_cache"] = _randn(g, 1.0, seqs, 1, longest, MLA_KV_LORA_RANK + MLA_ROPE_DIM)
        else:
            w["qkv"] = _randn(g, std, 3 * h, h)
            if s.arch == "qwen2_moe":
                w["qkv_bias"] = _randn(g, std, 3 * h)
            w["o"] = _randn(g, std, h, h)
            w["k_cache"] = _randn(g, 1.0, seqs, heads, longest, HEAD_DIM)
            w["v_cache"] = _randn(g, 1.0, seqs, heads, longest, HEAD_DIM)
        if s.arch != "mixtral":  # the shared expert stays on the Attention side
            shared = s.shared_intermediate if s.arch == "qwen2_moe" else inter
            w["shared_gate_up"] = _randn(g, std, 2 * shared, h)
            w["shared_down"] = _randn(g, std, h, shared)
            if s.arch == "qwen2_moe":
                w["shared_expert_gate"] = _randn(g, std, 1, h)
        return w

    def run(self, n: int) -> None:
        """One pass over every layer for the first ``n`` sequences."""
        x, residual = self.x[:n], self.residual[:n]
        positions = self.positions[:n]
        cos, sin = self.cos_cache[positions][:, None, :], self.sin_cache[positions][:, None, :]
        for w in self.layers:
            self._layer(w, x, residual, positions, cos, sin, n)

    def _layer(
        self,
        w: dict[str, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        n: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One layer; returns what goes on: the residual, the routes' weights, the shared expert's output."""
        s = self.shape
        rows, mask = self.rows[:n], self.mask[:n]
        hidden, residual = add_rms(x, residual, w["in_norm"])
        if self.mla:
            attn = self._mla(w, hidden, rows, positions, cos, sin, mask, n)
        else:
            qkv = F.linear(hidden, w["qkv"], w.get("qkv_bias"))
            q, k, v = (t.reshape(n, s.heads, HEAD_DIM) for t in qkv.split(s.hidden, dim=-1))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k_cache, v_cache = w["k_cache"], w["v_cache"]
            k_cache[rows, :, positions] = k
            v_cache[rows, :, positions] = v
            out = F.scaled_dot_product_attention(q[:, :, None, :], k_cache[:n], v_cache[:n], attn_mask=mask)
            attn = out.reshape(n, s.hidden)
        out = F.linear(attn, w["o"])
        hidden, residual = add_rms(out, residual, w["post_norm"])
        logits = F.linear(hidden, w["gate"])
        topk_weights, _ = torch.topk(torch.softmax(logits, dim=-1), s.top_k, dim=-1)
        if s.arch == "mixtral":
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        shared = None
        if "shared_gate_up" in w:
            shared = F.linear(_silu_mul(F.linear(hidden, w["shared_gate_up"])), w["shared_down"])
            if "shared_expert_gate" in w:
                shared = torch.sigmoid(F.linear(hidden, w["shared_expert_gate"])) * shared
        return residual, topk_weights, shared

    def _mla(
        self,
        w: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        heads = self.shape.heads
        q = F.linear(hidden, w["q"]).reshape(n, heads, MLA_NOPE_DIM + MLA_ROPE_DIM)
        q_nope, q_pe = q.split([MLA_NOPE_DIM, MLA_ROPE_DIM], dim=-1)
        latent, k_pe = F.linear(hidden, w["kv_a"]).split([MLA_KV_LORA_RANK, MLA_ROPE_DIM], dim=-1)
        latent = _rms(latent, w["kv_a_norm"])
        q_pe, k_pe = _rope(q_pe, cos, sin), _rope(k_pe[:, None, :], cos, sin)[:, 0]
        cache = w["latent_cache"]
        cache[rows, 0, positions] = torch.cat((latent, k_pe), dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w["w_uk"]).transpose(0, 1)  # [n, heads, 512]
        query = torch.cat((q_latent, q_pe), dim=-1)[:, None]  # [n, 1, heads, 576]: the heads share one latent
        keys = cache[:n]
        out = F.scaled_dot_product_attention(
            query, keys, keys[..., :MLA_KV_LORA_RANK], attn_mask=mask, scale=(MLA_NOPE_DIM + MLA_ROPE_DIM) ** -0.5
        )  # [n, 1, heads, 512]
        return torch.bmm(out[:, 0].transpose(0, 1), w["w_uv"]).transpose(0, 1).reshape(n, heads * MLA_V_DIM)


class TorchFfnSide:
    """The FFN role's work per MoE layer: vLLM's CPU fused MoE over the routed experts."""

    def __init__(self, shape: ModelShape, seqs: int, g: torch.Generator) -> None:
        h, inter, experts, std = shape.hidden, shape.intermediate, shape.experts, shape.std
        self.inter = inter
        self.layers = [
            (_randn(g, std, experts, 2 * inter, h), _randn(g, std, experts, h, inter)) for _ in range(shape.layers)
        ]
        self.x = _randn(g, 1.0, seqs, h)
        probs = torch.softmax(torch.randn(seqs, experts, generator=g), dim=-1)
        self.topk_weights, self.topk_ids = torch.topk(probs, shape.top_k, dim=-1)

    def run(self, n: int) -> None:
        """One pass over every layer for the first ``n`` tokens."""
        x, weights, ids = self.x[:n], self.topk_weights[:n], self.topk_ids[:n]
        for w13, w2 in self.layers:
            self._moe(x, w13, w2, weights, ids)

    def _moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
        token_rows = order // ids.shape[1]
        gathered = x[token_rows]
        outputs = torch.empty_like(gathered)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                up = F.linear(gathered[start:end], w13[expert])
                outputs[start:end] = F.linear(_silu_mul(up), w2[expert])
                start = end
        out = torch.zeros_like(x)
        out.index_add_(0, token_rows, outputs * weights.flatten()[order][:, None])
        return out
