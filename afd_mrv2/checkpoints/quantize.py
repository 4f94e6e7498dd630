"""Quantized copies of a safetensors checkpoint, in layouts vLLM loads (torch and safetensors only).

``quantize_checkpoint(src, dst, scheme)``, ``scheme`` one of :data:`SCHEMES`:

* ``fp8_block``: every 2-D projection weight (``*_proj.weight``, ``kv_a_proj_with_mqa.weight``) as
  float8_e4m3fn with one float32 ``weight_scale_inv`` per 128x128 block (value = q * s; DeepSeek-V3's layout);
* ``w8a8``: compressed-tensors int8 on the routed experts' projections: channel-wise weights (float32
  ``weight_scale`` ``[N, 1]``), dynamic per-token int8 activations;
* ``w4a16``: compressed-tensors ``pack-quantized`` int4 on the routed experts (one float32 ``weight_scale``
  per 128 input columns, eight values q + 8 per int32 ``weight_packed``, low bits first; unquantized activations).

Other tensors are copied unchanged, each into its file; the index and config.json are rewritten.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from afd_mrv2.errors import ConfigError

__all__ = ["SCHEMES", "Scheme", "fp8_block", "int4_group", "int8_channel", "quantize_checkpoint"]

BLOCK = 128  # fp8_block's block edge
GROUP = 128  # w4a16's group size (input columns per scale)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INDEX = "model.safetensors.index.json"
#: a linear projection's weight (attention, shared and routed experts); not the router (``mlp.gate.weight``)
PROJ = re.compile(r"_proj(_with_mqa)?\.weight$")
#: a routed expert's projection weight
EXPERT_PROJ = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
EXPERT_TARGETS = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]


def fp8_block(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` (``[N, K]``) as float8_e4m3fn and its float32 ``weight_scale_inv`` (``[ceil(N/128), ceil(K/128)]``)."""
    n, k = weight.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(rows * BLOCK, cols * BLOCK)[:n, :k]
    return {"weight": q.to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def int8_channel(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` as int8 with one float32 ``weight_scale`` per output channel (``[N, 1]``)."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    q = (weight.float() / scale).round().clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}


def int4_group(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` (``[N, K]``, K a multiple of 128) as compressed-tensors' packed int4: ``weight_packed``
    (int32 ``[N, K/8]``), float32 ``weight_scale`` (``[N, K/128]``), ``weight_shape`` (int64 ``[N, K]``)."""
    n, k = weight.shape
    if k % GROUP:
        raise ConfigError("scheme", f"w4a16 needs input sizes divisible by {GROUP}, got a weight of shape [{n}, {k}]")
    groups = weight.float().view(n, k // GROUP, GROUP)
    scale = (groups.abs().amax(dim=2) / 7.0).clamp(min=1e-12)
    q = (groups / scale[:, :, None]).round().clamp(-8, 7).view(n, k).to(torch.int64) + 8
    shifts = torch.arange(8, dtype=torch.int64) * 4
    packed = (q.view(n, k // 8, 8) << shifts).sum(dim=2)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([n, k])}


def _compressed_tensors(fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None) -> dict[str, Any]:
    group = {"targets": EXPERT_TARGETS, "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"experts": group}, "ignore": []}


@dataclass(frozen=True)
class Scheme:
    """Which 2-D weights a scheme quantizes, how (the tensors replacing ``.weight``), and the config it declares."""

    names: re.Pattern[str]
    quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    quantization_config: dict[str, Any]


_INT = {"type": "int", "symmetric": True, "dynamic": False}
SCHEMES: dict[str, Scheme] = {
    "fp8_block": Scheme(
        PROJ,
        fp8_block,
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
    ),
    "w8a8": Scheme(
        EXPERT_PROJ,
        int8_channel,
        _compressed_tensors(
            "int-quantized",
            {"num_bits": 8, **_INT, "strategy": "channel"},
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
        ),
    ),
    "w4a16": Scheme(
        EXPERT_PROJ,
        int4_group,
        _compressed_tensors("pack-quantized", {"num_bits": 4, **_INT, "strategy": "group", "group_size": GROUP}, None),
    ),
}


def _quantize_file(tensors: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if scheme.names.search(name) and tensor.dim() == 2:
            stem = name[: -len("weight")]
            out.update({stem + suffix: t.contiguous() for suffix, t in scheme.quantize(tensor).items()})
        else:
            out[name] = tensor
    return out


def _rewrite_index(dst: Path, written: dict[str, dict[str, int]]) -> None:
    index = json.loads((dst / INDEX).read_text())
    index["weight_map"] = {name: file for file, sizes in sorted(written.items()) for name in sorted(sizes)}
    total = sum(size for sizes in written.values() for size in sizes.values())
    index["metadata"] = {**index.get("metadata", {}), "total_size": total}
    (dst / INDEX).write_text(json.dumps(index, indent=2))


def quantize_checkpoint(src: Path | str, dst: Path | str, scheme: str) -> Path:
    """Write ``src``'s checkpoint quantized by ``scheme`` to the folder ``dst`` (created); returns ``dst``."""
    src, dst = Path(src), Path(dst)
    if scheme not in SCHEMES:
        raise ConfigError("scheme", f"unknown quantization scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConfigError("src", f"{src} holds no *.safetensors file")
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ConfigError("src", f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if dst.resolve() == src.resolve():
        raise ConfigError("dst", f"{dst} is the source checkpoint; write the quantized copy to another folder")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    written: dict[str, dict[str, int]] = {}  # per file, each tensor's size in bytes
    for file in files:
        tensors = _quantize_file(load_file(str(file)), SCHEMES[scheme])
        save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
        written[file.name] = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    if (dst / INDEX).exists():
        _rewrite_index(dst, written)
    config["quantization_config"] = copy.deepcopy(SCHEMES[scheme].quantization_config)
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst
