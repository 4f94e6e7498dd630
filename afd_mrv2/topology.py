"""The AFD rank map: which global rank plays which role, and where each expert lives.

Layout of the ``A + F`` global ranks of one AFD process group::

    global rank 0 .. A-1        attention ranks 0 .. A-1
    global rank A .. A+F-1      FFN ranks 0 .. F-1

Experts are sharded across the FFN ranks in contiguous blocks: FFN rank ``f``
is the primary holder of the routed experts ``[f * E/F, (f+1) * E/F)`` (so ``E % F == 0``).  Every
attention rank exchanges one message pair with every FFN rank per work item:
it dispatches to FFN rank ``f`` exactly the tokens that have at least one of
their top-k experts on ``f`` (possibly none: then only a control header travels)
and gets back ``f``'s partial output for them.  An FFN rank therefore serves all
``A`` attention ranks and batches their tokens into one expert computation, as
in MegaScale-Infer's M:N disaggregated expert parallelism.

The shared expert is replicated on every FFN rank and computed, for each token,
by the FFN rank that computes the token's top-1 expert.  The token travels there
anyway, so the shared expert costs no extra transfer, and an FFN rank none of
whose experts is selected receives no token at all (the case "an FFN rank
receives zero tokens" is real, not a formality).

Expert replicas (``expert_replicas = R``, default 1): every routed expert lives on
``R`` distinct FFN ranks, its primary (the block above) and the next ``R-1``
ranks around the ring (:class:`~afd_mrv2.placement.Placement`); FFN rank ``f`` then
holds ``R`` blocks (:meth:`Topology.held_by`), and each (token, expert) pair goes to
the expert's first live holder.  ``R = 1`` is exactly the blocks above.

Attention and FFN rank counts are independent (any ``A >= 1``, ``F >= 1``, e.g.
3A2F or 2A3F): since every FFN rank serves every attention rank, nothing pairs an
attention rank with one FFN rank, and ``F`` need not divide ``A`` (the upstream
plugin's ``A % F == 0`` is a convention of connectors that pair ranks, such as
CAMP2P, which checks it itself).  Only ``E % F == 0`` is required: the checks on
``E``, ``F`` and ``R`` are :class:`~afd_mrv2.placement.Placement`'s, and so is their
exception (:class:`~afd_mrv2.placement.PlacementError`, a ``ValueError``).
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
