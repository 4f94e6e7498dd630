"""Where each routed expert lives (a table of holders), and which live holder serves it.

:class:`Placement` (``ring``, ``from_table``, ``route``, ``routing``, ``describe``, ``digest``),
:class:`PlacementStamp` (what a pair's two sides compare at their handshake), :class:`PlacementError`.

See docs/internals/p2p-transport.md, "afd_mrv2.placement".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from afd_mrv2.errors import AfdError

Holders = tuple[tuple[int, ...], ...]


class PlacementError(AfdError, ValueError):
    """A table that places no deployment: no FFN rank, holders out of range or repeated, an FFN rank holding nothing."""


class NoLiveHolder(AfdError):
    """Some expert has no live holder left: the deployment cannot serve (serve stops, as without replicas)."""


@dataclass(frozen=True)
class PlacementStamp:
    """A placement as a pair's handshake compares it: its :attr:`Placement.digest` and its one-line summary."""

    digest: str
    summary: str

    @property
    def short(self) -> str:
        """``sha256:1a2b3c4d``: the digest's first 8 hex digits, for messages."""
        return self.digest[: len("sha256:") + 8]


@dataclass(frozen=True)
class Placement:
    """The expert-to-holders table of ``num_experts`` experts on ``num_ffn`` FFN ranks.

    ``holders[e]``: the FFN ranks holding expert ``e``, primary first.  Built by :meth:`ring` (also
    ``Placement(E, F, R)``: ``holders`` left empty) or :meth:`from_table`; ``replicas`` is then the
    most holders of any expert (1: no expert has a second holder, no failover).
    """

    num_experts: int
    num_ffn: int
    replicas: int = 1
    holders: Holders = ()

    def __post_init__(self) -> None:
        if self.num_ffn < 1:
            raise PlacementError(f"need at least one FFN rank, got {self.num_ffn}")
        if not self.holders:
            object.__setattr__(self, "holders", _ring(self.num_experts, self.num_ffn, self.replicas))
        _check(self.holders, self.num_ffn)
        if (self.num_experts, self.replicas) != (len(self.holders), max(map(len, self.holders))):
            raise PlacementError(
                f"num_experts ({self.num_experts}) and replicas ({self.replicas}) disagree with the table "
                f"({len(self.holders)} experts, at most {max(map(len, self.holders))} holders)"
            )

    @classmethod
    def ring(cls, num_experts: int, num_ffn: int, replicas: int = 1) -> Placement:
        """Balanced contiguous blocks (the first ``E % F`` ranks one expert more, as vLLM's ``linear``), each
        block's replicas on the next ``R-1`` ranks around the ring."""
        return cls(num_experts, num_ffn, replicas)

    @classmethod
    def from_table(cls, holders: Iterable[Iterable[int]], num_ffn: int) -> Placement:
        """Any table: ``holders[e]`` lists expert ``e``'s FFN ranks (1..F distinct ranks in ``0..F-1``), primary first."""
        table = tuple(tuple(h) for h in holders)
        if not table:
            raise PlacementError("the placement table lists no expert")
        if any(not h for h in table):
            raise PlacementError(f"expert {next(e for e, h in enumerate(table) if not h)} has no holder")
        return cls(len(table), num_ffn, max(map(len, table)), table)

    @property
    def is_ring(self) -> bool:
        """Whether the table is :meth:`ring`'s for its experts, FFN ranks and replicas."""
        return self.holders == _ring(self.num_experts, self.num_ffn, self.replicas)

    def held_by(self, ffn: int) -> tuple[int, ...]:
        """The experts FFN rank ``ffn`` keeps (ascending)."""
        if not 0 <= ffn < self.num_ffn:
            raise AfdError(f"no FFN rank {ffn} among {self.num_ffn}")
        return tuple(e for e, h in enumerate(self.holders) if ffn in h)

    def primary(self, ffn: int) -> tuple[int, ...]:
        """The experts FFN rank ``ffn`` is the first holder of (ascending)."""
        return tuple(e for e, h in enumerate(self.holders) if h[0] == ffn)

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
            lines.append(f"FFN rank {ffn}: experts {_ranges(held)} ({len(held)}; primary {_ranges(self.primary(ffn))})")
        return lines

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of the canonical JSON of ``holders``: equal tables, equal digests (holder order counts)."""
        text = json.dumps([list(h) for h in self.holders], separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    @property
    def summary(self) -> str:
        """``ring, 256 experts on 4 FFN ranks, 2 replicas`` (``table, ...`` for any other table; ``1-2 replicas``
        where experts have different holder counts)."""
        counts = sorted({len(h) for h in self.holders})
        copies = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        plural = "" if copies == "1" else "s"
        kind = "ring" if self.is_ring else "table"
        ranks = "FFN rank" if self.num_ffn == 1 else "FFN ranks"
        return f"{kind}, {self.num_experts} experts on {self.num_ffn} {ranks}, {copies} replica{plural}"

    @property
    def stamp(self) -> PlacementStamp:
        """What this side of a pair shows its peer at the handshake."""
        return PlacementStamp(self.digest, self.summary)

    def table(self) -> dict[str, list[list[int]]]:
        """``{"holders": [[f, ...], ...]}``: the table as ``afd.placement`` takes it."""
        return {"holders": [list(h) for h in self.holders]}


def _ring(num_experts: int, num_ffn: int, replicas: int) -> Holders:
    """The ring's table; refuses ``R`` outside ``1..F`` and fewer experts than FFN ranks (a rank would hold none)."""
    if not 1 <= replicas <= num_ffn:
        raise PlacementError(f"expert_replicas must be in 1..{num_ffn} (the FFN ranks), got {replicas}")
    if num_experts < num_ffn:
        raise PlacementError(
            f"num_experts ({num_experts}) must be at least the FFN ranks ({num_ffn}): every FFN rank holds an expert"
        )
    base, extra = divmod(num_experts, num_ffn)
    starts = [f * base + min(f, extra) for f in range(num_ffn + 1)]
    primary = [f for f in range(num_ffn) for _ in range(starts[f], starts[f + 1])]
    return tuple(tuple((p + j) % num_ffn for j in range(replicas)) for p in primary)


def _check(holders: Holders, num_ffn: int) -> None:
    """Every expert has 1..F distinct holders in ``0..F-1``; every FFN rank holds at least one expert."""
    for e, h in enumerate(holders):
        if not h or len(set(h)) != len(h) or not all(type(f) is int and 0 <= f < num_ffn for f in h):
            raise PlacementError(
                f"expert {e}: holders {list(h)} must be 1..{num_ffn} distinct FFN ranks in 0..{num_ffn - 1}"
            )
    empty = sorted(set(range(num_ffn)) - {f for h in holders for f in h})
    if empty:
        raise PlacementError(f"FFN rank(s) {', '.join(map(str, empty))} hold no expert; every FFN rank holds one")


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
