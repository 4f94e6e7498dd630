"""The AFD rank map: which global rank plays which role, and where each expert lives (:class:`Topology`).

See docs/internals/p2p-transport.md, "afd_mrv2.topology".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.placement import Placement, PlacementError


@dataclass(frozen=True)
class Topology:
    """``num_attention`` x ``num_ffn`` ranks sharing ``num_experts`` routed experts, each on
    ``expert_replicas`` FFN ranks."""

    num_attention: int
    num_ffn: int
    num_experts: int
    expert_replicas: int = 1

    def __post_init__(self) -> None:
        """Refuses no attention rank here, and the FFN ranks, experts and replicas as :class:`Placement` does."""
        if self.num_attention < 1:
            raise PlacementError(f"need at least one attention rank, got {self.num_attention}A{self.num_ffn}F")
        _ = self.placement  # Placement's checks: one check, one exception type

    @cached_property
    def placement(self) -> Placement:
        """The expert-to-holders table (``expert_replicas`` holders per expert)."""
        return Placement(self.num_experts, self.num_ffn, self.expert_replicas)

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn

    @property
    def experts_per_ffn(self) -> int:
        return self.num_experts // self.num_ffn

    def role_of(self, global_rank: int) -> tuple[str, int]:
        """``(role, index within the role)`` of a global rank."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"global rank {global_rank} outside 0..{self.world_size - 1}")
        if global_rank < self.num_attention:
            return ATTENTION, global_rank
        return FFN, global_rank - self.num_attention

    def global_rank(self, role: str, index: int) -> int:
        if role == ATTENTION and 0 <= index < self.num_attention:
            return index
        if role == FFN and 0 <= index < self.num_ffn:
            return self.num_attention + index
        raise ValueError(f"no {role} rank {index} in a {self.num_attention}A{self.num_ffn}F topology")

    def peers_of(self, global_rank: int) -> list[int]:
        """Global ranks a rank exchanges data with: every rank of the other role."""
        role, _ = self.role_of(global_rank)
        if role == ATTENTION:
            return [self.global_rank(FFN, f) for f in range(self.num_ffn)]
        return [self.global_rank(ATTENTION, a) for a in range(self.num_attention)]

    def experts_of(self, ffn_index: int) -> range:
        """The routed experts FFN rank ``ffn_index`` is the primary holder of (its block)."""
        per = self.experts_per_ffn
        return range(ffn_index * per, (ffn_index + 1) * per)

    def held_by(self, ffn_index: int) -> tuple[int, ...]:
        """The routed experts FFN rank ``ffn_index`` keeps (ascending): its block and, with replicas,
        the ``R-1`` blocks before it around the ring."""
        return self.placement.held_by(ffn_index)

    def primary_of(self, expert: int) -> int:
        """The FFN rank whose block routed expert ``expert`` is in: its primary holder."""
        return expert // self.experts_per_ffn

    def owner_of(self, expert: int) -> int:
        """Deprecated since 0.3.0 (an *owner* is what runs an executor): :meth:`primary_of`."""
        warnings.warn(
            "Topology.owner_of is deprecated since afd-mrv2 0.3.0: use Topology.primary_of (the expert's primary holder)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.primary_of(expert)

    def describe(self, global_rank: int) -> str:
        """``"FFN rank 1 (global rank 3)"``: how errors and reports name a rank."""
        role, index = self.role_of(global_rank)
        return f"{'attention' if role == ATTENTION else 'FFN'} rank {index} (global rank {global_rank})"

    def __str__(self) -> str:
        replicas = f", {self.expert_replicas} replicas" if self.expert_replicas > 1 else ""
        return f"{self.num_attention}A{self.num_ffn}F, {self.num_experts} experts{replicas}"
