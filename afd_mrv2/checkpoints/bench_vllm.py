"""The bench layer of :mod:`afd_mrv2.checkpoints.bench` built from vLLM's own CPU kernels (when vLLM is installed).

:func:`available` says whether it can run; nothing here imports vLLM at module import time.

See docs/internals/reference.md, "afd_mrv2.checkpoints.bench_vllm".
"""

from __future__ import annotations

import math
from typing import Any

import torch

from afd_mrv2.checkpoints.archs import HEAD_DIM, ModelShape
from afd_mrv2.checkpoints.bench_torch import add_rms  # RMSNorm.forward_native: torch ops in vLLM's eager CPU engine too

BLOCK_SIZE = 128  # vLLM's CPU KV-cache block size (platforms/cpu.py) for standard attention


def _ops() -> Any:
    from vllm import _custom_ops

    return _custom_ops


def available() -> str | None:
    """None when vLLM's CPU kernels can be used here, else why not (one line)."""
    try:
        ops = _ops()
    except Exception as exc:  # noqa: BLE001 - any import failure means no usable vLLM kernels
        return f"vLLM is not importable ({type(exc).__name__})"
    needed = ("create_onednn_mm", "onednn_mm", "cpu_prepack_moe_weight", "cpu_fused_moe", "cpu_attention_with_kv_cache")
    missing = [name for name in needed if not hasattr(ops, name)]
    if missing:
        return f"vLLM lacks {', '.join(missing)}"
    if not getattr(ops, "_supports_onednn", False):
        return "vLLM was built without oneDNN"
    return None


def _attention_isa() -> str:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(torch.float32, BLOCK_SIZE, HEAD_DIM))
    except Exception:  # noqa: BLE001 - a vLLM without this helper: its x86 fp32 choice
        return "vec"


class VllmAttentionSide:
    """The Attention engine's work per MoE layer through vLLM's CPU ops (standard attention only)."""

    def __init__(self, shape: ModelShape, contexts: torch.Tensor, g: torch.Generator) -> None:
        if shape.arch == "deepseek_v2":
            raise ValueError("MLA attention is measured with the torch emulation")
        self.ops = ops = _ops()
        self.shape = shape
        self.isa = _attention_isa()
        seqs, h, heads, std = contexts.numel(), shape.hidden, shape.heads, shape.std
        inter = shape.shared_intermediate
        blocks = math.ceil(int(contexts.max()) / BLOCK_SIZE)
        self.block_table = torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks)
        self.positions = (contexts - 1).long()
        self.slots = self.block_table[torch.arange(seqs), self.positions // BLOCK_SIZE].long() * BLOCK_SIZE + (
            self.positions % BLOCK_SIZE
        )
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        angles = torch.outer(torch.arange(int(contexts.max()), dtype=torch.float32), inv_freq)
        self.cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        self.x = torch.randn(seqs, h, generator=g)
        self.residual = torch.randn(seqs, h, generator=g)

        def mm(*dims: int) -> Any:  # a prepacked oneDNN matmul of a drawn [out, in] weight
            return ops.create_onednn_mm((torch.randn(*dims, generator=g) * std).t(), 32)

        self.layers: list[dict[str, Any]] = []
        for _ in range(shape.layers):
            w: dict[str, Any] = {"in_norm": torch.ones(h), "post_norm": torch.ones(h)}
            w["qkv"] = mm(3 * h, h)
            w["qkv_bias"] = torch.randn(3 * h, generator=g) * std if shape.arch == "qwen2_moe" else None
            w["o"], w["gate"] = mm(h, h), mm(shape.experts, h)
            if shape.arch == "qwen2_moe":
                w["shared_gate_up"], w["shared_down"], w["shared_expert_gate"] = (
                    mm(2 * inter, h),
                    mm(h, inter),
                    mm(1, h),
                )
            cache = torch.randn(seqs * blocks, heads, BLOCK_SIZE, 2 * HEAD_DIM, generator=g)
            w["kv"] = cache.view(seqs * blocks, heads, BLOCK_SIZE * 2, HEAD_DIM).chunk(2, dim=2)
            self.layers.append(w)
        self.meta: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        for n in (seqs, seqs // 2):
            starts = torch.arange(n + 1, dtype=torch.int32)
            lengths = contexts[:n].to(torch.int32)
            scheduler = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=n,
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=HEAD_DIM,
                seq_lens=lengths,
                dtype=torch.float32,
                query_start_loc=starts,
                causal=True,
                sliding_window_size=-1,
                isa=self.isa,
                enable_kv_split=False,
            )
            self.meta[n] = (starts, lengths, scheduler)

    def run(self, n: int) -> None:
        """One pass over every layer for the first ``n`` sequences (``n``: all of them or half)."""
        ops, s = self.ops, self.shape
        h, heads, inter = s.hidden, s.heads, s.shared_intermediate
        starts, lengths, scheduler = self.meta[n]
        for w in self.layers:
            x, residual = add_rms(self.x[:n], self.residual[:n], w["in_norm"])
            q, k, v = ops.onednn_mm(w["qkv"], x, w["qkv_bias"]).split([h, h, h], dim=-1)
            q, k = q.contiguous(), k.contiguous()
            ops.rotary_embedding(self.positions[:n], q, k, HEAD_DIM, self.cos_sin, True)
            key_cache, value_cache = w["kv"]
            ops.cpu_attn_reshape_and_cache(
                k.view(n, heads, HEAD_DIM), v.view(n, heads, HEAD_DIM), key_cache, value_cache, self.slots[:n], self.isa
            )
            out = torch.empty(n, heads, HEAD_DIM)
            ops.cpu_attention_with_kv_cache(
                query=q.view(n, heads, HEAD_DIM),
                key_cache=key_cache,
                value_cache=value_cache,
                output=out,
                query_start_loc=starts,
                seq_lens=lengths,
                scale=HEAD_DIM**-0.5,
                causal=True,
                alibi_slopes=None,
                sliding_window=-1,
                block_table=self.block_table[:n],
                softcap=0.0,
                scheduler_metadata=scheduler,
                s_aux=None,
            )
            hidden, residual = add_rms(ops.onednn_mm(w["o"], out.view(n, h), None), residual, w["post_norm"])
            logits = ops.onednn_mm(w["gate"], hidden, None)
            torch.topk(torch.softmax(logits, dim=-1), s.top_k, dim=-1)
            if s.arch == "qwen2_moe":
                act = torch.empty(n, inter)
                torch.ops._C.silu_and_mul(act, ops.onednn_mm(w["shared_gate_up"], hidden, None))
                shared = ops.onednn_mm(w["shared_down"], act, None)
                shared.mul_(torch.sigmoid(ops.onednn_mm(w["shared_expert_gate"], hidden, None)))


class VllmFfnSide:
    """The FFN role's work per MoE layer: vLLM's ``cpu_fused_moe`` on prepacked weights."""

    def __init__(self, shape: ModelShape, seqs: int, g: torch.Generator) -> None:
        self.ops = ops = _ops()
        h, inter, experts, std = shape.hidden, shape.intermediate, shape.experts, shape.std
        self.layers = [
            (
                ops.cpu_prepack_moe_weight(torch.randn(experts, 2 * inter, h, generator=g) * std, "vec"),
                ops.cpu_prepack_moe_weight(torch.randn(experts, h, inter, generator=g) * std, "vec"),
            )
            for _ in range(shape.layers)
        ]
        self.x = torch.randn(seqs, h, generator=g)
        probs = torch.softmax(torch.randn(seqs, experts, generator=g), dim=-1)
        self.topk_weights, ids = torch.topk(probs, shape.top_k, dim=-1)
        self.topk_ids = ids.to(torch.int32)

    def run(self, n: int) -> None:
        """One pass over every layer for the first ``n`` tokens."""
        out = torch.empty(n, self.x.shape[1])
        x, weights, ids = self.x[:n], self.topk_weights[:n], self.topk_ids[:n]
        for w13, w2 in self.layers:
            self.ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, "silu", "vec")
