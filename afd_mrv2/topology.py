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
    #: the placement table (``afd.placement``); empty: the ring of ``expert_replicas``
    holders: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def over(cls, num_attention: int, placement: Placement) -> Topology:
        """``num_attention`` Attention ranks and the FFN ranks, experts and table of ``placement``."""
        return cls(num_attention, placement.num_ffn, placement.num_experts, placement.replicas, placement.holders)

    def __post_init__(self) -> None:
        """Refuses no attention rank here, and the FFN ranks, experts and replicas as :class:`Placement` does."""
        if self.num_attention < 1:
            raise PlacementError(f"need at least one attention rank, got {self.num_attention}A{self.num_ffn}F")
        _ = self.placement  # Placement's checks: one check, one exception type

    @cached_property
    def placement(self) -> Placement:
        """The expert-to-holders table: ``holders``, else the ring with ``expert_replicas`` holders per expert."""
        return Placement(self.num_experts, self.num_ffn, self.expert_replicas, self.holders)

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn

    @property
    def experts_per_ffn(self) -> int:
        """The most experts any FFN rank is the primary holder of (``E / F`` when F divides E, on the ring)."""
        return max(len(self.placement.primary(f)) for f in range(self.num_ffn))

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
        """The routed experts FFN rank ``ffn_index`` is the primary holder of (its block); a table whose primaries
        of that rank are not one block is refused (use :meth:`held_by`)."""
        primary = self.placement.primary(ffn_index)
        block = range(primary[0], primary[-1] + 1) if primary else range(0)
        if tuple(block) != primary:
            raise PlacementError(
                f"FFN rank {ffn_index}'s primary experts {Placement.ranges(primary)} are not one block"
            )
        return block

    def held_by(self, ffn_index: int) -> tuple[int, ...]:
        """The routed experts FFN rank ``ffn_index`` keeps (ascending): on the ring its block and, with replicas,
        the ``R-1`` blocks before it around the ring."""
        return self.placement.held_by(ffn_index)

    def primary_of(self, expert: int) -> int:
        """The FFN rank whose block routed expert ``expert`` is in: its primary holder."""
        return self.placement.holders[expert][0]

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
        replicas += "" if not self.holders or self.placement.is_ring else f", placement {self.placement.stamp.short}"
        return f"{self.num_attention}A{self.num_ffn}F, {self.num_experts} experts{replicas}"
