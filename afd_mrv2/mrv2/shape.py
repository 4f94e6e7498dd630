"""The shape of a MoE layer as both roles' transfers see it, read from vLLM's ``FusedMoEConfig``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeShape:
    """What the transfer needs to know of a MoE layer (read from its vLLM ``FusedMoEConfig``)."""

    hidden_size: int
    top_k: int
    num_experts: int
