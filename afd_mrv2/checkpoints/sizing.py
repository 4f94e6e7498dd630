"""Each role's weight bytes, held and read at start, for a checkpoint and an (A, F, R) deployment, reading no weights.

:func:`size_checkpoint` counts each kind of weight from the safetensors headers (exact) where the
folder has ``*.safetensors``, else from ``config.json`` alone (:mod:`afd_mrv2.checkpoints.sizing_config`);
:func:`plan_roles` splits them over the roles (an Attention engine holds everything but the routed
experts; an FFN rank only its experts, ``Placement.held_by``) and counts what each reads: every tensor
but the routed-expert weights it does not hold.  Multi-token-prediction layers are left out.
See docs/serve.md, "Sizing a deployment: afd-mrv2 plan".
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from afd_mrv2.architectures import is_routed_expert, routed_expert_id
from afd_mrv2.checkpoints.sizing_config import (
    KINDS,
    expert_intermediate,
    kinds_from_config,
    moe_layers,
    num_experts,
    widths,
)
from afd_mrv2.errors import ConfigError
from afd_mrv2.placement import Placement

__all__ = ["KINDS", "ModelBytes", "RolePlan", "kind_of", "plan_roles", "read_header", "size_checkpoint"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: the routed-expert tensors vLLM's expert filter skips when their expert is not held; it reads every other one
#: (the scales), ``vllm.model_executor.model_loader.ep_weight_filter.should_skip_weight``
FILTERED_SUFFIXES = (".weight", ".weight_packed")
#: quantization scales (fp8: ``weight_scale_inv``, per-tensor ``weight_scale`` / ``input_scale``)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
_ROUTER = re.compile(r"\.(?:mlp|block_sparse_moe)\.gate\.(?:weight|e_score_correction_bias)$")


@dataclass(frozen=True)
class ModelBytes:
    """A checkpoint's weight bytes: ``kinds`` over the whole model (MTP layers apart, in ``mtp``),
    ``expert_bytes[e]`` routed expert ``e``'s bytes summed over the MoE layers, ``expert_scale_bytes[e]`` the
    part of them every role reads (its scales: tensors not ending in :data:`FILTERED_SUFFIXES`)."""

    model: str
    arch: str
    source: str
    width: str
    moe_layers: int
    kinds: Mapping[str, int]
    expert_bytes: tuple[int, ...]
    expert_scale_bytes: tuple[int, ...]
    mtp: int = 0
    mtp_layers: int = 0

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    @property
    def num_experts(self) -> int:
        return len(self.expert_bytes)


@dataclass(frozen=True)
class RolePlan:
    """Each of the ``ranks`` of one role: ``experts`` routed experts (``routed_bytes``); ``weights`` the bytes it
    holds (an Attention engine everything but the routed experts, an FFN rank its routed experts and nothing
    else); ``reads`` the bytes it reads at start (every tensor but the routed-expert weights it does not hold:
    an FFN rank reads and drops the rest, every role reads every routed expert's scales)."""

    role: str
    ranks: tuple[int, ...]
    experts: int
    routed_bytes: int
    weights: int
    reads: int


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: its 8-byte little-endian length, then that many bytes of JSON."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(str(path), "not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        text = f.read(length)
    if len(text) != length:
        raise ConfigError(str(path), f"not a safetensors file (header of {length} bytes cut short)")
    header: dict[str, Any] = json.loads(text)
    return header


def kind_of(name: str) -> str:
    """The kind of checkpoint tensor ``name`` (scales follow their weight)."""
    checks = (
        ("routed_experts", is_routed_expert(name)),
        ("router", bool(_ROUTER.search(name))),
        ("shared_experts", ".shared_expert" in name),
        ("attention", ".self_attn." in name),
        ("embeddings", name.endswith("embed_tokens.weight")),
        ("lm_head", name.startswith("lm_head.")),
        ("norms", name.endswith("norm.weight")),
        ("dense_mlp", ".mlp." in name),
    )
    return next((kind for kind, hit in checks if hit), "other")


def _load_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError("MODEL", f"no config.json in {folder}")
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError("MODEL", f"{path} is not JSON: {exc}") from None
    return config


def _mtp(config: Mapping[str, Any]) -> int:
    """The multi-token-prediction layers ``config`` declares (DeepSeek-V3: 1), which plan leaves out."""
    return int(config.get("num_nextn_predict_layers") or 0)


def _count(name: str, info: Mapping[str, Any], parameters: bool) -> int:
    """A tensor's bytes, or its elements when counting ``parameters`` (quantization scales then count 0)."""
    if not parameters:
        start, end = info["data_offsets"]
        return int(end) - int(start)
    if name.endswith(SCALE_SUFFIXES):
        return 0
    return prod(int(d) for d in info["shape"])


def _from_headers(folder: Path, files: list[Path], config: Mapping[str, Any], parameters: bool) -> ModelBytes:
    layers, experts = config["num_hidden_layers"], num_experts(config)
    kinds, per_expert, scales, mtp, dtypes = dict.fromkeys(KINDS, 0), [0] * experts, [0] * experts, 0, set()
    for path in files:
        for name, info in read_header(path).items():
            if name == "__metadata__":
                continue
            dtypes.add(str(info["dtype"]))
            size, layer = _count(name, info, parameters), _LAYER.search(name)
            if layer and int(layer.group(1)) >= layers:
                mtp += size
                continue
            kind = kind_of(name)
            kinds[kind] += size
            index = routed_expert_id(name)
            if index is not None and index < experts:
                per_expert[index] += size
                scales[index] += 0 if name.endswith(FILTERED_SUFFIXES) else size
    if sum(per_expert) != kinds["routed_experts"]:
        raise ConfigError("MODEL", f"{folder}: routed-expert tensors without a per-expert index are not sized here")
    source = f"safetensors headers ({len(files)} file{'s' * (len(files) > 1)})"
    width = "parameters" if parameters else "+".join(sorted(dtypes))
    return ModelBytes(
        folder.name,
        config["model_type"],
        source,
        width,
        moe_layers(config),
        kinds,
        tuple(per_expert),
        tuple(scales),
        mtp,
        _mtp(config),
    )


def size_checkpoint(model: str | Path, *, parameters: bool = False) -> ModelBytes:
    """Each kind's bytes (or ``parameters``) of the checkpoint in folder ``model`` (or of the ``config.json``
    named): from its safetensors headers when it has any, else from its ``config.json`` alone."""
    path = Path(model)
    folder = path.parent if path.name == "config.json" else path
    config = _load_config(folder)
    try:  # also checks the architecture and the widths
        kinds, expert = kinds_from_config(config, parameters=parameters)
    except (KeyError, TypeError) as exc:
        what = f"it has no {exc} key" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(str(folder / "config.json"), f"cannot size this {config.get('model_type')}: {what}") from None
    files = sorted(folder.glob("*.safetensors")) if path.is_dir() else []
    if files:
        return _from_headers(folder, files, config, parameters)
    w, layers = widths(config, parameters=parameters), moe_layers(config)
    scale = expert - 3 * config["hidden_size"] * expert_intermediate(config) * (w.linear if w.quantized else w.base)
    per_expert, scales = (expert * layers,) * num_experts(config), (scale * layers,) * num_experts(config)
    name = folder.resolve().name
    return ModelBytes(
        name, config["model_type"], "config.json", w.label, layers, kinds, per_expert, scales, 0, _mtp(config)
    )


def plan_roles(sizes: ModelBytes, attention: int, ffn: int, replicas: int = 1) -> list[RolePlan]:
    """One entry for the Attention engines (all alike: ``ranks`` 0..A-1) and one per run of FFN ranks holding
    and reading the same bytes."""
    if attention < 1:
        raise ConfigError("--attention", f"expected an integer >= 1, got {attention}")
    placement = Placement(sizes.num_experts, ffn, replicas)
    rest, scales = sizes.total - sizes.kinds["routed_experts"], sum(sizes.expert_scale_bytes)
    out = [RolePlan("attention", tuple(range(attention)), 0, 0, rest, rest + scales)]
    for rank in range(ffn):
        held = placement.held_by(rank)
        mine = sum(sizes.expert_bytes[e] for e in held)
        reads = rest + mine + scales - sum(sizes.expert_scale_bytes[e] for e in held)
        plan = RolePlan("ffn", (rank,), len(held), mine, mine, reads)
        last = out[-1]
        if (last.role, last.experts, last.weights, last.reads) == ("ffn", len(held), mine, reads):
            plan = RolePlan("ffn", (*last.ranks, rank), len(held), mine, mine, reads)
            out.pop()
        out.append(plan)
    return out
