"""The routed experts a process holds: :func:`role_held_set`, :class:`HeldExpertMap`, and :func:`held_experts`
of a built model.

A routed-experts layer built with a :class:`HeldExpertMap` allocates exactly ``held`` (global ids, in
local order) and upstream's ``weight_loader`` skips every other expert; the ``afd`` load format reads
the union of the model's held sets.  See docs/rfc/0006-per-role-weights.md, sections 2 and 4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from afd_mrv2.config import AfdConfig
from afd_mrv2.items import ATTENTION
from afd_mrv2.topology import Topology


def role_held_set(config: AfdConfig, num_experts: int) -> tuple[int, ...]:
    """The global ids of the routed experts a role's layers hold, ascending: none on the Attention role, and
    ``afd.placement``'s share of the FFN rank ``config.rank`` (the ring with replicas by default)."""
    if config.role == ATTENTION:
        return ()
    return Topology.over(config.num_attention_ranks, config.placement_for(num_experts)).held_by(config.rank)


class HeldExpertMap(ExpertMapManager):
    """vLLM's ``ExpertMapManager`` whose local experts are exactly ``held``; the rest map to -1."""

    def __init__(self, base: ExpertMapManager, held: Sequence[int]) -> None:
        self.held = tuple(held)  # read by _calculate_expert_maps, which upstream's __init__ calls
        super().__init__(
            max_num_batched_tokens=base.max_num_batched_tokens,
            top_k=base.top_k,
            global_num_experts=base.global_num_experts,
            num_redundant_experts=0,
            num_expert_group=None,
            moe_parallel_config=base.moe_parallel_config,
            placement_strategy=base.placement_strategy,
            enable_eplb=False,
        )

    def _calculate_expert_maps(self) -> None:
        expert_map = torch.full((self.global_num_experts,), -1, dtype=torch.int32)
        if self.held:
            ids = torch.tensor(self.held, dtype=torch.long)
            expert_map[ids] = torch.arange(len(self.held), dtype=torch.int32)
        self._local_num_experts, self._expert_map, self._expert_mask = len(self.held), expert_map, None


def held_experts(model: torch.nn.Module) -> frozenset[int] | None:
    """The global ids of the routed experts ``model``'s layers hold; None unless every one has a held set."""
    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    managers = [layer.expert_map_manager for layer in layers]  # RoutedExperts.__init__ assigns it
    if not layers or not all(isinstance(m, HeldExpertMap) for m in managers):
        return None  # upstream's layers (or none): the loader keeps upstream's filter
    return frozenset(e for m in managers for e in m.held)
