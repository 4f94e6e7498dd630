"""Analytic model of the executor's schedule: predicted makespan and depth choice.

Given per-phase times (recv, compute, send), the number of items ``N`` and the
depth ``d``, the model replays the executor's event graph with fixed durations:

* each role's stream runs its ops one at a time, in issue order (item-major:
  recv(k), compute(k), send(k) before item k+1), and roles mapped to one stream
  share it (the serialized schedule maps all three to one);
* compute(k) starts after recv(k) ended, send(k) after compute(k) ended;
* recv(k) starts after send(k - d) ended: the slot-reuse edge.

With all roles on distinct streams and balanced phases ``T`` this gives the
steady-state period ``max(r, c, s, (r + c + s) / d)`` per item: depth 2 keeps
two of the three phases busy, depth 3 all three.  ``choose_depth`` returns the
smallest depth whose makespan is within ``tolerance`` (5 %) of the unbounded-depth
makespan.  MegaScale-Infer's rule of thumb (m >= 2(1 + Tc/Tf) micro-batches for a
two-way ping-pong) is a special case of the same reasoning for its topology.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from afd_mrv2.config import MAX_DEPTH
from afd_mrv2.items import PHASES

PIPELINED = {"recv": "recv", "compute": "compute", "send": "send"}
SERIALIZED = {"recv": "serial", "compute": "serial", "send": "serial"}


@dataclass(frozen=True)
class PhaseTimes:
    """Durations of one item's three phases (any unit; the model keeps it)."""

    recv: float
    compute: float
    send: float

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.recv, self.compute, self.send)


def predict_makespan(
    times: PhaseTimes | Sequence[PhaseTimes],
    items: int,
    depth: int,
    *,
    streams: dict[str, str] | None = None,
) -> float:
    """Makespan of ``items`` items at ``depth``; ``times`` per item or one for all.

    ``streams`` maps each phase to a stream name (default: three distinct streams;
    use :data:`SERIALIZED` for the serialized schedule).
    """
    if items < 1 or depth < 1:
        raise ValueError(f"items and depth must be >= 1, got items={items}, depth={depth}")
    per_item = [times] * items if isinstance(times, PhaseTimes) else list(times)
    if len(per_item) != items:
        raise ValueError(f"got {len(per_item)} phase times for {items} items")
    mapping = streams or PIPELINED
    free: dict[str, float] = {}  # stream -> time its last op ends
    send_end: list[float] = []
    for k, t in enumerate(per_item):
        ready = send_end[k - depth] if k >= depth else 0.0  # slot reuse
        end = 0.0
        for phase, duration in zip(PHASES, t.as_tuple(), strict=True):
            stream = mapping[phase]
            start = max(free.get(stream, 0.0), ready)
            end = start + duration
            free[stream] = end
            ready = end  # the next phase of this item depends on this one
        send_end.append(end)
    return max(send_end)


def unbounded_makespan(times: PhaseTimes | Sequence[PhaseTimes], items: int) -> float:
    """Makespan with as many slots as items (no slot-reuse constraint)."""
    return predict_makespan(_horizon(times, items), items, items)


def choose_depth(
    times: PhaseTimes | Sequence[PhaseTimes], items: int = 64, *, tolerance: float = 0.05, max_depth: int = MAX_DEPTH
) -> int:
    """Smallest depth whose predicted makespan is within ``tolerance`` of unbounded.

    ``times`` is one item's phase times, or measured samples: samples are repeated
    over the horizon in order, so their variance counts (a slot's recv -> compute
    -> send cycle has less slack at small depths, and one slow phase stalls it).
    ``items`` is the horizon the choice is made for (64: long enough that fill and
    drain do not dominate).
    """
    per_item = _horizon(times, items)
    target = predict_makespan(per_item, items, items) * (1 + tolerance)
    for depth in range(1, max_depth + 1):
        if predict_makespan(per_item, items, depth) <= target:
            return depth
    return max_depth


def _horizon(times: PhaseTimes | Sequence[PhaseTimes], items: int) -> list[PhaseTimes]:
    if isinstance(times, PhaseTimes):
        return [times] * items
    if not times:
        raise ValueError("no phase-time samples")
    return [times[i % len(times)] for i in range(items)]


def median_phase_times(samples: Sequence[Sequence[float]]) -> PhaseTimes:
    """Per-phase medians of ``samples`` (each ``(recv, compute, send)``)."""
    if not samples:
        raise ValueError("no phase-time samples")

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    return PhaseTimes(*(median([s[i] for s in samples]) for i in range(3)))
