"""Each kind's weight bytes from ``config.json`` alone: the tensor shapes each architecture's config implies.

:func:`kinds_from_config`; the widths (``torch_dtype``/``dtype``, fp8 with float32 block scales) are
:class:`Widths`.  See docs/serve.md, "Sizing a deployment: afd-mrv2 plan".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import ceil
from typing import Any

from afd_mrv2.architectures import (
    ARCH_TYPES,
    DEEPSEEK_TYPES,
    expert_intermediate,
    moe_layers,
    num_experts,
)
from afd_mrv2.errors import ConfigError

__all__ = [
    "ARCH_TYPES",
    "KINDS",
    "Widths",
    "expert_intermediate",
    "kinds_from_config",
    "moe_layers",
    "num_experts",
    "widths",
]

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1}
#: the kinds every count is split into (``mtp``, the multi-token-prediction layers, is counted apart and held by no role)
KINDS = (
    "routed_experts",
    "router",
    "shared_experts",
    "dense_mlp",
    "attention",
    "embeddings",
    "lm_head",
    "norms",
    "other",
)


@dataclass(frozen=True)
class Widths:
    """Bytes per element of the unquantized tensors (``base``) and of the quantized linear weights
    (``linear``, with a float32 scale per ``block`` when fp8 is block-scaled, per tensor when ``block`` is None)."""

    base: int
    linear: int
    block: tuple[int, int] | None = None
    quantized: bool = False
    label: str = ""

    def matrix(self, rows: int, cols: int) -> int:
        """A linear layer's weight of ``rows x cols``, with its scales when quantized."""
        if not self.quantized:
            return rows * cols * self.base
        scales = 1 if self.block is None else ceil(rows / self.block[0]) * ceil(cols / self.block[1])
        return rows * cols * self.linear + 4 * scales

    def plain(self, elements: int) -> int:
        """An unquantized tensor (norms, biases, router, embeddings)."""
        return elements * self.base


def widths(config: Mapping[str, Any], *, parameters: bool = False) -> Widths:
    """The widths ``config`` declares: its dtype, and fp8 from its ``quantization_config``; with ``parameters``
    every element counts 1 and scales none (the counts are then parameters)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "")
    if name.removeprefix("torch.") not in DTYPE_BYTES:
        raise ConfigError("config.json", f"torch_dtype/dtype: expected one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    base = DTYPE_BYTES[name.removeprefix("torch.")]
    if parameters:
        return Widths(1, 1, label="parameters")
    quant = config.get("quantization_config")
    if not quant:
        return Widths(base, base, label=name)
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if method != "fp8":
        raise ConfigError("config.json", f"quantization_config quant_method {method!r} is not sized here (known: fp8)")
    block = quant.get("weight_block_size")
    shape = (int(block[0]), int(block[1])) if block else None
    scales = f"{shape[0]}x{shape[1]} block" if shape else "per-tensor"
    return Widths(base, 1, shape, quantized=True, label=f"fp8 linear weights + float32 {scales} scales; {name} others")


def _mlp(w: Widths, hidden: int, inter: int) -> int:
    """A gated MLP: gate and up (``inter x hidden``) and down (``hidden x inter``)."""
    return 2 * w.matrix(inter, hidden) + w.matrix(hidden, inter)


def _deepseek_attention(c: Mapping[str, Any], w: Widths) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v, kv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    q_lora = c.get("q_lora_rank")
    q = w.matrix(heads * (nope + rope), h)
    if q_lora:
        q = w.matrix(q_lora, h) + w.plain(q_lora) + w.matrix(heads * (nope + rope), q_lora)
    return q + w.matrix(kv + rope, h) + w.plain(kv) + w.matrix(heads * (nope + v), kv) + w.matrix(h, heads * v)


def _gqa_attention(c: Mapping[str, Any], w: Widths, *, bias: bool, qk_norm: bool) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, dim = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads
    out = 2 * w.matrix(heads * dim, h) + 2 * w.matrix(kv * dim, h)  # q and o, k and v
    if bias:
        out += w.plain((heads + 2 * kv) * dim)
    if qk_norm:
        out += w.plain(2 * dim)
    return out


def _layer_parts(c: Mapping[str, Any], w: Widths) -> dict[str, int]:
    """One MoE layer's router and shared experts; its attention; one dense layer's MLP."""
    h, e, kind = c["hidden_size"], num_experts(c), c["model_type"]
    router, shared = w.plain(e * h), 0
    if kind in DEEPSEEK_TYPES:
        attention = _deepseek_attention(c, w)
        bias = 1 if w.label == "parameters" else 4  # e_score_correction_bias: float32
        router += bias * e if c.get("topk_method") == "noaux_tc" else 0
        shared = _mlp(w, h, expert_intermediate(c) * (c.get("n_shared_experts") or 0))
    else:
        attention = _gqa_attention(c, w, bias=kind == "qwen2_moe", qk_norm=kind == "qwen3_moe")
        if c.get("attention_bias") and kind == "qwen3_moe":
            attention += w.plain((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * c["head_dim"] + h)
    if kind == "qwen2_moe":
        shared = _mlp(w, h, c["shared_expert_intermediate_size"]) + w.plain(h)  # + shared_expert_gate (1 x h)
    return {"attention": attention, "router": router, "shared": shared, "dense": _mlp(w, h, c["intermediate_size"])}


def kinds_from_config(config: Mapping[str, Any], *, parameters: bool = False) -> tuple[dict[str, int], int]:
    """Each kind's bytes (or ``parameters``) over the whole model (no MTP layer) and one routed expert's in one
    MoE layer."""
    c = config
    if c.get("model_type") not in ARCH_TYPES:
        raise ConfigError(
            "config.json", f"model_type: expected one of {', '.join(ARCH_TYPES)}, got {c.get('model_type')!r}"
        )
    w = widths(c, parameters=parameters)
    h, layers, moe = c["hidden_size"], c["num_hidden_layers"], moe_layers(c)
    part = _layer_parts(c, w)
    expert = _mlp(w, h, expert_intermediate(c))
    embeddings = w.plain(c["vocab_size"] * h)
    kinds = dict.fromkeys(KINDS, 0)
    kinds.update(
        routed_experts=moe * num_experts(c) * expert,
        router=moe * part["router"],
        shared_experts=moe * part["shared"],
        dense_mlp=(layers - moe) * part["dense"],
        attention=layers * part["attention"],
        embeddings=embeddings,
        lm_head=0 if c.get("tie_word_embeddings") else embeddings,
        norms=w.plain((2 * layers + 1) * h),
    )
    return kinds, expert
