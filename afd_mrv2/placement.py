"""Where each routed expert lives when experts are replicated, and which live holder serves it.

:class:`Placement` (``route``, ``routing``, ``describe``), :class:`PlacementError`.

See docs/internals/p2p-transport.md, "afd_mrv2.placement".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from afd_mrv2.errors import AfdError


class PlacementError(AfdError, ValueError):
    """FFN ranks, experts or replicas that make no placement (``E % F != 0``, ``R`` outside ``1..F``, no FFN rank)."""


class NoLiveHolder(AfdError):
    """Some expert has no live holder left: the deployment cannot serve (serve stops, as without replicas)."""


@dataclass(frozen=True)
class Placement:
    """The expert-to-holders table of ``num_experts`` experts on ``num_ffn`` ranks, ``replicas`` copies each."""

    num_experts: int
    num_ffn: int
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.num_ffn < 1:
            raise PlacementError(f"need at least one FFN rank, got {self.num_ffn}")
        if not 1 <= self.replicas <= self.num_ffn:
            raise PlacementError(f"expert_replicas must be in 1..{self.num_ffn} (the FFN ranks), got {self.replicas}")
        if self.num_experts < self.num_ffn or self.num_experts % self.num_ffn:
            raise PlacementError(
                f"num_experts ({self.num_experts}) must be a multiple of the FFN ranks ({self.num_ffn})"
            )

    @property
    def block(self) -> int:
        """Experts per block (``E / F``): an FFN rank's primary experts."""
        return self.num_experts // self.num_ffn

    @cached_property
    def holders(self) -> tuple[tuple[int, ...], ...]:
        """``holders[e]``: the FFN ranks holding expert ``e``, primary first."""
        return tuple(
            tuple((e // self.block + j) % self.num_ffn for j in range(self.replicas)) for e in range(self.num_experts)
        )

    def held_by(self, ffn: int) -> tuple[int, ...]:
        """The experts FFN rank ``ffn`` keeps (ascending): ``R`` blocks."""
        if not 0 <= ffn < self.num_ffn:
            raise AfdError(f"no FFN rank {ffn} among {self.num_ffn}")
        return tuple(e for e, h in enumerate(self.holders) if ffn in h)

    def route(self, expert: int, live: Iterable[int]) -> int:
        """The FFN rank that computes ``expert`` while the ranks ``live`` are up: its first live holder."""
        up = set(live)
        for ffn in self.holders[expert]:
            if ffn in up:
                return ffn
        raise NoLiveHolder(
            f"expert {expert} has no live holder: its holders {list(self.holders[expert])} are all lost "
            f"(live FFN ranks: {sorted(up) or 'none'})"
        )

    def routing(self, live: Iterable[int]) -> tuple[int, ...]:
        """``routing[e]``: the FFN rank computing expert ``e`` (:meth:`route` for every expert);
        :class:`NoLiveHolder` naming the first expert without a live holder."""
        up = frozenset(live)
        return tuple(self.route(e, up) for e in range(self.num_experts))

    def survives(self, lost: Sequence[int]) -> bool:
        """Whether every expert keeps a live holder when the ranks ``lost`` are gone."""
        gone = set(lost)
        return all(any(h not in gone for h in hs) for hs in self.holders)

    @staticmethod
    def ranges(experts: Sequence[int]) -> str:
        """``0-3,8-11``: ascending experts as compact ranges."""
        return _ranges(experts)

    def describe(self) -> list[str]:
        """One line per FFN rank: the experts it holds, as ranges (what serve prints at start)."""
        lines = []
        for ffn in range(self.num_ffn):
            held = self.held_by(ffn)
            primary = [e for e in held if self.holders[e][0] == ffn]
            lines.append(f"FFN rank {ffn}: experts {_ranges(held)} ({len(held)}; primary {_ranges(primary)})")
        return lines


def _ranges(experts: Sequence[int]) -> str:
    """``0-3,8-11``: ascending experts as compact ranges."""
    parts: list[str] = []
    start = prev = None
    for e in experts:
        if prev is not None and e == prev + 1:
            prev = e
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = e
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts) or "none"
