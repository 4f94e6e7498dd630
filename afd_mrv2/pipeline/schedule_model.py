"""Analytic model of the executor's schedule: predicted makespan and buffer-count choice (``choose_buffers``).

See docs/internals/pipeline.md, "afd_mrv2.pipeline.schedule_model".
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
    depth_out: int | None = None,
    streams: dict[str, str] | None = None,
) -> float:
    """Makespan of ``items`` items with ``depth`` input and ``depth_out`` (default:
    ``depth``) output buffers; ``times`` per item or one for all.

    ``streams`` maps each phase to a stream name (default: three distinct streams;
    use :data:`SERIALIZED` for the serialized schedule).
    """
    depth_in = depth
    depth_out = depth if depth_out is None else depth_out
    if items < 1 or depth_in < 1 or depth_out < 1:
        raise ValueError(f"items and buffer counts must be >= 1, got items={items}, in={depth_in}, out={depth_out}")
    per_item = [times] * items if isinstance(times, PhaseTimes) else list(times)
    if len(per_item) != items:
        raise ValueError(f"got {len(per_item)} phase times for {items} items")
    mapping = streams or PIPELINED
    free: dict[str, float] = {}  # stream -> time its last op ends
    ends: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for k, t in enumerate(per_item):
        ready = {
            "recv": ends["compute"][k - depth_in] if k >= depth_in else 0.0,  # input reuse
            "compute": ends["send"][k - depth_out] if k >= depth_out else 0.0,  # output reuse
            "send": 0.0,
        }
        previous = 0.0  # the end of this item's previous phase
        for phase, duration in zip(PHASES, t.as_tuple(), strict=True):
            stream = mapping[phase]
            start = max(free.get(stream, 0.0), ready[phase], previous)
            previous = free[stream] = start + duration
            ends[phase].append(previous)
    return max(ends["send"])


def unbounded_makespan(times: PhaseTimes | Sequence[PhaseTimes], items: int) -> float:
    """Makespan with as many buffers as items (no reuse constraint)."""
    return predict_makespan(_horizon(times, items), items, items)


def steady_period(times: PhaseTimes, depth_in: int, depth_out: int) -> float:
    """The steady-state time per item with three distinct streams (the closed form)."""
    r, c, s = times.as_tuple()
    return max(r, c, s, (r + c) / depth_in, (c + s) / depth_out)


@dataclass(frozen=True)
class BufferChoice:
    """The (input, output) buffer counts chosen, and why."""

    depth_in: int
    depth_out: int
    makespan: float  # predicted, over the horizon
    fastest: float  # the unbounded makespan the tolerance is measured from


def choose_buffers(
    times: PhaseTimes | Sequence[PhaseTimes],
    items: int = 64,
    *,
    bytes_in: int = 1,
    bytes_out: int = 1,
    tolerance: float = 0.05,
    max_depth: int = MAX_DEPTH,
) -> BufferChoice:
    """The (depth_in, depth_out) with the fewest buffer bytes among those within
    ``tolerance`` of the unbounded makespan (ties: fewer buffers, then fewer inputs).

    ``times`` is one item's phase times, or measured samples: samples are repeated
    over the horizon in order, so their variance counts (a buffer's cycle has less
    slack at small counts, and one slow phase stalls it).  ``items`` is the
    horizon the choice is made for (64: long enough that fill and drain do not
    dominate).  ``bytes_in`` / ``bytes_out`` are one input / output buffer's bytes
    as measured; unknown sizes (0) count as 1 so the choice still minimises the count.
    """
    per_item = _horizon(times, items)
    fastest = predict_makespan(per_item, items, items)
    target = fastest * (1 + tolerance)
    size_in, size_out = max(bytes_in, 1), max(bytes_out, 1)
    best: tuple[tuple[int, int, int], BufferChoice] | None = None
    for depth_in in range(1, max_depth + 1):
        for depth_out in range(1, max_depth + 1):
            makespan = predict_makespan(per_item, items, depth_in, depth_out=depth_out)
            if makespan > target:
                continue
            rank = (depth_in * size_in + depth_out * size_out, depth_in + depth_out, depth_in)
            if best is None or rank < best[0]:
                best = (rank, BufferChoice(depth_in, depth_out, makespan, fastest))
    if best is None:
        makespan = predict_makespan(per_item, items, max_depth)
        return BufferChoice(max_depth, max_depth, makespan, fastest)
    return best[1]


def choose_depth(
    times: PhaseTimes | Sequence[PhaseTimes], items: int = 64, *, tolerance: float = 0.05, max_depth: int = MAX_DEPTH
) -> int:
    """Smallest equal buffer count (``multistream.depth``) within ``tolerance`` of unbounded."""
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
