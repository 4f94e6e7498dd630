"""What a role process read and holds: bytes read from the checkpoint and resident parameter bytes, each by
kind (routed experts, everything else), and its peak RSS (:func:`current_memory`).

The ``afd`` load format records a load here (:func:`count_read`, :func:`record_load`); the Attention engine's
live figures and the FFN rank's ``done`` report read :func:`current_memory`.  A process that loaded with
another format reports no figures (None).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from afd_mrv2.architectures import is_routed_expert
from afd_mrv2.live_stats import MemoryFigures
from afd_mrv2.procs import peak_rss_bytes

ROUTED, OTHER = "routed_experts", "other"
KINDS = (ROUTED, OTHER)


def kind_of(name: str) -> str:
    """The kind of the checkpoint tensor ``name``."""
    return ROUTED if is_routed_expert(name) else OTHER


@dataclass
class _Load:
    read: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    resident: dict[str, int] | None = None


_lock = threading.Lock()
_load: _Load | None = None


def count_read(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, counting each tensor's bytes by kind as the loader reads it (a new load starts from 0)."""
    global _load
    read = dict.fromkeys(KINDS, 0)
    with _lock:
        _load = _Load(read)  # the same dict: the figures grow as the loader reads
    for name, tensor in weights:
        read[kind_of(name)] += tensor.numel() * tensor.element_size()
        yield name, tensor


def parameter_bytes(model: torch.nn.Module) -> dict[str, int]:
    """``model``'s parameter bytes by kind (routed experts: the parameters of vLLM's routed-experts layers)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts  # here: the figures need no vLLM

    out = dict.fromkeys(KINDS, 0)
    routed = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
    for p in model.parameters():
        out[ROUTED if id(p) in routed else OTHER] += p.numel() * p.element_size()
    return out


def record_load(model: torch.nn.Module) -> None:
    """After the load: the parameters ``model`` holds (after the quant method's processing)."""
    global _load
    with _lock:
        if _load is not None:
            _load = dataclasses.replace(_load, resident=parameter_bytes(model))


def current_memory() -> MemoryFigures | None:
    """This process's figures: what its ``afd`` load read and holds, and its peak RSS now; None without one."""
    with _lock:
        load = _load
    if load is None or load.resident is None:
        return None
    return MemoryFigures(
        read_bytes=dict(load.read), resident_bytes=dict(load.resident), peak_rss_bytes=peak_rss_bytes()
    )
