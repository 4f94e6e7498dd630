"""What a MoE checkpoint's ``config.json`` says about its routed experts, per architecture.

Which decoder layers are MoE layers, how many routed experts each has and their sizes, where the
experts sit in the checkpoint's names (:func:`is_routed_expert`, :func:`routed_expert_id`), and the routed-experts layer vLLM builds for them
(:func:`experts_layer_args`, the keyword values of vLLM's ``FusedMoEFactory`` call in each model).
Read by ``afd-mrv2 plan`` (sizing) and by the FFN role's experts-only model; no torch, no vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from afd_mrv2.errors import ConfigError

DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
QWEN_TYPES = ("qwen2_moe", "qwen3_moe")
ARCH_TYPES = (*DEEPSEEK_TYPES, *QWEN_TYPES, "mixtral")
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")


def is_routed_expert(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a routed expert's, per expert (``...experts.<id>.<proj>``) or fused
    (``...experts.<proj>``); a shared expert's (``shared_experts.``/``shared_expert.``) is not."""
    return ".experts." in name and ".shared_expert" not in name


def routed_expert_id(name: str) -> int | None:
    """The routed expert id in checkpoint tensor ``name`` (``...experts.<id>.``), else None (fused, shared, other)."""
    match = _EXPERT_ID.search(name)
    return int(match.group(1)) if match and is_routed_expert(name) else None


def model_type(config: Mapping[str, Any]) -> str:
    """The config's ``model_type``, refused in one line unless afd-mrv2 knows its experts."""
    kind = config.get("model_type")
    if kind not in ARCH_TYPES:
        raise ConfigError("model_type", f"expected one of {', '.join(ARCH_TYPES)}, got {kind!r}")
    return str(kind)


def is_moe_layer(c: Mapping[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` has routed experts."""
    if c["model_type"] in DEEPSEEK_TYPES:
        first, freq = int(c.get("first_k_dense_replace") or 0), int(c.get("moe_layer_freq") or 1)
        return layer >= first and layer % freq == 0
    if c["model_type"] in QWEN_TYPES:
        step, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or ())
        return layer not in dense and (layer + 1) % step == 0
    return True


def moe_layer_indices(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The decoder layers with routed experts (MTP layers beyond ``num_hidden_layers`` not counted)."""
    return tuple(i for i in range(int(config["num_hidden_layers"])) if is_moe_layer(config, i))


def moe_layers(config: Mapping[str, Any]) -> int:
    """How many of the decoder layers are MoE layers (MTP layers beyond ``num_hidden_layers`` not counted)."""
    return len(moe_layer_indices(config))


def num_experts(config: Mapping[str, Any]) -> int:
    """The routed experts of each MoE layer."""
    key = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}
    return int(config[key.get(config["model_type"], "n_routed_experts")])


def expert_intermediate(config: Mapping[str, Any]) -> int:
    """Each routed expert's intermediate size."""
    return int(config["intermediate_size" if config["model_type"] == "mixtral" else "moe_intermediate_size"])


def experts_prefix(config: Mapping[str, Any], layer: int) -> str:
    """The routed-experts layer's name in decoder layer ``layer`` (the checkpoint's names start with it)."""
    block = "block_sparse_moe" if model_type(config) == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.experts"


def experts_layer_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword values vLLM's model passes to ``FusedMoEFactory`` for a MoE layer of this config, those
    that shape the routed experts and their kernel (router inputs such as the gate and its correction bias,
    the shared experts and EPLB excluded: an FFN rank runs no router)."""
    kind = model_type(config)
    args: dict[str, Any] = {
        "num_experts": num_experts(config),
        "top_k": int(config["num_experts_per_tok"]),
        "hidden_size": int(config["hidden_size"]),
        "intermediate_size": expert_intermediate(config),
    }
    if kind == "mixtral":
        args.update(renormalize=True, ckpt_names=("w1", "w2", "w3"))
    elif kind in QWEN_TYPES:
        args.update(renormalize=bool(config.get("norm_topk_prob", False)))
    else:  # DeepSeek-V2/V3, Kimi-K2: grouped top-k, the routed scale applied to the output (vLLM's CPU/GPU path)
        args.update(
            renormalize=bool(config.get("norm_topk_prob", False)),
            use_grouped_topk=True,
            num_expert_group=config.get("n_group") or 1,
            topk_group=config.get("topk_group") or 1,
            scoring_func=config.get("scoring_func") or "softmax",
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            apply_routed_scale_to_output=True,
        )
    return args
