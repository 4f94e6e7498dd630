"""Per-layer compute of a checkpoint's two AFD sides at the bench load, on one core (torch or vLLM's kernels).

Micro-batching an Attention step (two micro-batches of 32 sequences instead of one
of 64) pays only when half a batch really costs about half a whole one.  Small fp32
GEMMs on a CPU are bound by their weight reads, so at small batches they do not:
:func:`measure_layer_compute` measures, for one MoE layer of ``shape`` and the bench
load (:data:`BENCH_LOAD`: 64 decoding sequences), each side's compute for the full
decode batch and for its first half:

* **Attention side** (``A`` full, ``a`` half), what afd-mrv2's Attention engine runs
  per layer in vLLM 0.32 (CPU, fp32): the fused residual add + RMSNorm, the QKV
  projection (Qwen2-MoE: with q/k/v biases), the rotary embedding (gathered by
  position from a cos/sin cache), the write of the new key/value into the KV cache
  and the decode attention of each sequence over its own context (one batched
  ``scaled_dot_product_attention`` call with a length mask, as vLLM's CPU attention
  backend makes one kernel call for the batch), the output projection, the
  post-attention add + RMSNorm, the router GEMM (hidden x experts) with softmax and
  top-k, and the shared expert where the architecture has one (Qwen2-MoE: gated,
  DeepSeek-V2: ungated): afd-mrv2 keeps it with the Attention engine.  DeepSeek-V2's
  attention is MLA in the absorbed decode form (queries mapped into the 512-wide
  latent, attention over the 576-wide latent cache, values mapped back per head).
* **FFN side** (``F`` full, ``f`` half), vLLM's CPU unquantized fused MoE for the
  layer: the routed (token, expert) pairs sorted by expert, then per expert the
  gate_up GEMM ``[tokens_e, H] x [H, 2I]``, SiLU-and-mul, the down GEMM
  ``[tokens_e, I] x [I, H]``, and the weighted scatter-add back to the tokens.
  Routes are a seeded random top-k (the bench checkpoint's router is balanced-ish).

Plain torch is the emulation everywhere; where vLLM is installed, ``kernels="auto"``
(the default) runs the same layer through vLLM's own CPU kernels instead
(:mod:`afd_mrv2.checkpoints.bench_vllm`: oneDNN matmuls on prepacked weights, vLLM's
paged CPU attention, ``cpu_fused_moe``), because on some CPUs a torch (MKL) GEMM of a
few rows costs far more than vLLM's prepacked MoE kernel, which makes the torch FFN
side's half/full read high (docs/benchmarks-vllm.md, "The bench checkpoint", has both).
DeepSeek-V2's MLA attention is always the torch emulation.

Every layer of ``shape`` gets its own weights and KV cache and one timed pass runs
all of them in order (as a forward does), so a layer's weights are as cold as in a
real forward; full and half passes alternate (their order too) and the result is
the median pass over the layer count.  torch runs on one thread meanwhile.

What it leaves out: the engine around the kernels.  In a real vLLM engine each
Attention-side layer also costs ~2.5 ms of eager Python (vLLM's layers, the AFD
seam) on the 2-core machine of the docs, which does not halve, and the two sides
slow each other down when they overlap (shared memory bandwidth); the docs have
the real numbers next to these.

The criteria the ``bench`` size is chosen for (``make-model --size bench`` prints
them as PASS/FAIL; docs/benchmarks-vllm.md, "The bench checkpoint", has the
measured numbers, emulated here and real in vLLM): ``a <= 0.6 A`` and ``f <= 0.6 F``
(:data:`HALF_MAX`), and ``a`` and ``f`` within 1.5x of each other
(:data:`BALANCE_MAX`), so that one micro-batch's attention can hide the other's
FFN round trip.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from afd_mrv2.checkpoints import bench_vllm
from afd_mrv2.checkpoints.archs import (
    HEAD_DIM,
    MLA_KV_LORA_RANK,
    MLA_NOPE_DIM,
    MLA_ROPE_DIM,
    MLA_V_DIM,
    ModelShape,
)
from afd_mrv2.errors import ConfigError
from afd_mrv2.table import format_table

#: A side's half-batch compute must be at most this fraction of its full-batch compute.
HALF_MAX = 0.6
#: The two sides' half-batch computes must be within this factor of each other.
BALANCE_MAX = 1.5
EPS = 1e-6
KERNELS = ("auto", "torch", "vllm")


@dataclass(frozen=True)
class BenchLoad:
    """The decode step measured: ``seqs`` sequences, one new token each, with prompts of
    ``prompt_min``..``prompt_max`` tokens (drawn per sequence) and ``decoded`` tokens decoded so far."""

    seqs: int = 64
    prompt_min: int = 16
    prompt_max: int = 32
    decoded: int = 96

    def contexts(self, generator: torch.Generator) -> torch.Tensor:
        """Each sequence's context length (its KV entries, the new token's included)."""
        prompts = torch.randint(self.prompt_min, self.prompt_max + 1, (self.seqs,), generator=generator)
        return prompts + self.decoded


#: 64 concurrent decoding sequences, prompts of 16-32 tokens, 96 tokens into decoding: a mean
#: context of about 120 (the middle of a 192-token generation).
BENCH_LOAD = BenchLoad()


@dataclass(frozen=True)
class SideCompute:
    """One side's per-layer compute (ms, median) for the full batch and for its first half."""

    side: str
    full_ms: float
    half_ms: float

    @property
    def half_ratio(self) -> float:
        return self.half_ms / self.full_ms if self.full_ms > 0 else math.inf

    @property
    def half_ok(self) -> bool:
        return self.half_ratio <= HALF_MAX


@dataclass(frozen=True)
class LayerCompute:
    """What :func:`measure_layer_compute` measured: ``A``/``a`` (attention) and ``F``/``f`` (FFN)."""

    arch: str
    attention: SideCompute
    ffn: SideCompute
    tokens: int
    half_tokens: int
    mean_context: float
    layers: int
    repeats: int
    #: which kernels measured each side: "torch" (the emulation) or "vllm" (vLLM's CPU ops)
    kernels: dict[str, str]
    #: why torch measured a side that ``kernels="auto"`` would have given to vLLM, else ""
    kernels_note: str = ""

    @property
    def balance(self) -> float:
        """``a / f``: the half-batch attention compute over the half-batch FFN compute."""
        return self.attention.half_ms / self.ffn.half_ms if self.ffn.half_ms > 0 else math.inf

    @property
    def balance_ok(self) -> bool:
        return 1 / BALANCE_MAX <= self.balance <= BALANCE_MAX

    @property
    def ok(self) -> bool:
        return self.attention.half_ok and self.ffn.half_ok and self.balance_ok

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: the four numbers per side, the ratios and the verdicts."""
        sides = {
            s.side: {**asdict(s), "half_ratio": round(s.half_ratio, 4), "half_ok": s.half_ok}
            for s in (self.attention, self.ffn)
        }
        return {
            "arch": self.arch,
            "tokens": self.tokens,
            "half_tokens": self.half_tokens,
            "mean_context": self.mean_context,
            "layers": self.layers,
            "repeats": self.repeats,
            "threads": 1,
            "kernels": dict(self.kernels),
            "kernels_note": self.kernels_note,
            **sides,
            "a_over_f": round(self.balance, 4),
            "balance_ok": self.balance_ok,
            "criteria": {"half_max": HALF_MAX, "balance_max": BALANCE_MAX},
            "ok": self.ok,
        }

    def report(self) -> str:
        """The table ``make-model --size bench`` prints."""

        def verdict(ok: bool) -> str:
            return "PASS" if ok else "FAIL"

        rows = [
            [s.side, round(s.full_ms, 3), round(s.half_ms, 3), round(s.half_ratio, 3), verdict(s.half_ok)]
            for s in (self.attention, self.ffn)
        ]
        head = (
            f"per-layer compute on one core ({self.arch}, decode step of {self.tokens} sequences, "
            f"half = {self.half_tokens}, mean context {self.mean_context:.0f}; median of {self.repeats} "
            f"passes over {self.layers} layers; kernels: attention {self.kernels['attention']}, "
            f"ffn {self.kernels['ffn']}{'; ' + self.kernels_note if self.kernels_note else ''}):"
        )
        table = format_table(["side", "full ms", "half ms", "half/full", f"<= {HALF_MAX}"], rows)
        tail = (
            f"a/f = {self.balance:.3f} (attention half / FFN half; within {BALANCE_MAX}x: "
            f"{verdict(self.balance_ok)}); overall: {verdict(self.ok)}"
        )
        return "\n".join([head, table, tail])


def measure_layer_compute(
    shape: ModelShape, load: BenchLoad = BENCH_LOAD, *, repeats: int = 21, seed: int = 0, kernels: str = "auto"
) -> LayerCompute:
    """Measure ``A``, ``a``, ``F`` and ``f`` for ``shape`` at ``load`` (see the module docstring).

    ``kernels``: ``"torch"`` (the plain-torch emulation), ``"vllm"`` (vLLM's CPU kernels; a
    :class:`~afd_mrv2.errors.ConfigError` when vLLM cannot run them here) or ``"auto"``
    (vLLM's where they can run, else torch)."""
    shape.check()
    if kernels not in KERNELS:
        raise ConfigError("--kernels", f"expected one of {', '.join(KERNELS)}, got {kernels!r}")
    if load.seqs < 2:
        raise ValueError(f"a bench load needs at least 2 sequences, got {load.seqs}")
    note = ""
    use_vllm = False
    if kernels != "torch":
        why = bench_vllm.available()
        if why is not None and kernels == "vllm":
            raise ConfigError("--kernels", f"vllm: {why}")
        use_vllm, note = why is None, why or ""
        if use_vllm and shape.arch == "deepseek_v2":
            note = "MLA attention is the torch emulation"
    generator = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            contexts = load.contexts(generator)
            attention: _AttentionSide | bench_vllm.VllmAttentionSide
            ffn: _FfnSide | bench_vllm.VllmFfnSide
            if use_vllm and shape.arch != "deepseek_v2":
                attention = bench_vllm.VllmAttentionSide(shape, contexts, generator)
            else:
                attention = _AttentionSide(shape, contexts, generator)
            ffn = (
                bench_vllm.VllmFfnSide(shape, load.seqs, generator)
                if use_vllm
                else _FfnSide(shape, load.seqs, generator)
            )
            used = {
                "attention": "vllm" if not isinstance(attention, _AttentionSide) else "torch",
                "ffn": "vllm" if not isinstance(ffn, _FfnSide) else "torch",
            }
            half = load.seqs // 2
            a_full, a_half = _time_pair(lambda: attention.run(load.seqs), lambda: attention.run(half), repeats)
            f_full, f_half = _time_pair(lambda: ffn.run(load.seqs), lambda: ffn.run(half), repeats)
    finally:
        torch.set_num_threads(threads)
    per_layer = 1e3 / shape.layers
    return LayerCompute(
        arch=shape.arch,
        attention=SideCompute("attention", a_full * per_layer, a_half * per_layer),
        ffn=SideCompute("ffn", f_full * per_layer, f_half * per_layer),
        tokens=load.seqs,
        half_tokens=half,
        mean_context=float(contexts.float().mean()),
        layers=shape.layers,
        repeats=repeats,
        kernels=used,
        kernels_note=note,
    )


def _time_pair(full: Callable[[], object], half: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of ``full()`` and of ``half()``, interleaved (alternating which goes first)."""
    for _ in range(2):
        full()
        half()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(max(1, repeats)):
        for is_full in (True, False) if i % 2 == 0 else (False, True):
            start = time.perf_counter()
            (full if is_full else half)()
            times[is_full].append(time.perf_counter() - start)
    return _median(times[True]), _median(times[False])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _randn(generator: torch.Generator, std: float, *dims: int) -> torch.Tensor:
    return torch.randn(*dims, generator=generator) * std


def _add_rms(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


class _AttentionSide:
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
        hidden, residual = _add_rms(x, residual, w["in_norm"])
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
        hidden, residual = _add_rms(out, residual, w["post_norm"])
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


class _FfnSide:
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
