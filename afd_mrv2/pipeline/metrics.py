"""Overlap metrics computed from traced spans: busy time, hidden communication, efficiency.

:func:`union`, :func:`overlap`, :func:`fraction` and the flow-shop lower bound.

See docs/internals/pipeline.md, "afd_mrv2.pipeline.metrics".
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from afd_mrv2.config import STREAM_PHASES as COMM_PHASES
from afd_mrv2.devices.base import Span
from afd_mrv2.items import PHASES


def union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``intervals`` (``(start, end)``, any order, overlapping or not) as sorted, disjoint intervals."""
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap(interval: tuple[int, int], merged: Sequence[tuple[int, int]]) -> int:
    """Length of ``interval`` covered by ``merged`` (sorted, disjoint, as :func:`union` gives): only the
    pieces it can touch.

    Bisecting keeps metrics of long runs (thousands of items) O(n log n) instead of O(n^2).
    """
    start, end = interval
    total = 0
    for i in range(max(0, bisect.bisect_right(merged, (start, start)) - 1), len(merged)):
        a, b = merged[i]
        if a >= end:
            break
        total += max(0, min(end, b) - max(start, a))
    return total


def fraction(part: float, whole: float) -> float:
    """``part / whole``, 0.0 while ``whole`` is 0 (nothing measured yet): the hidden fraction (hidden /
    round-trip or communication time), the busy fraction (busy / up time), the efficiency."""
    return part / whole if whole > 0 else 0.0


def covered_ns(spans: Iterable[Span]) -> int:
    """ns during which at least one of ``spans`` ran (overlaps counted once)."""
    return sum(b - a for a, b in union((s.start_ns, s.end_ns) for s in spans))


def busy_ns(spans: Iterable[Span]) -> dict[str, int]:
    """Stream name -> ns during which the stream ran at least one span."""
    per_stream: dict[str, list[Span]] = {}
    for span in spans:
        per_stream.setdefault(span.stream_name, []).append(span)
    return {name: covered_ns(group) for name, group in per_stream.items()}


def hidden_comm_fraction(spans: Sequence[Span]) -> float:
    """Fraction of recv+send time spent while some compute span was running."""
    compute = union((s.start_ns, s.end_ns) for s in spans if s.name == "compute")
    comm = [(s.start_ns, s.end_ns) for s in spans if s.name in COMM_PHASES]
    return fraction(sum(overlap(iv, compute) for iv in comm), sum(b - a for a, b in comm))


def makespan_ns(spans: Sequence[Span]) -> int:
    if not spans:
        return 0
    return max(s.end_ns for s in spans) - min(s.start_ns for s in spans)


def stage_times(spans: Iterable[Span]) -> list[tuple[int, int, int]]:
    """Per work item (issue order), its (recv, compute, send) durations in ns."""
    items: dict[object, dict[str, int]] = {}
    for span in spans:
        if span.name in PHASES and span.item is not None:
            items.setdefault(span.item, {})[span.name] = span.duration_ns
    recv, compute, send = PHASES
    return [(times.get(recv, 0), times.get(compute, 0), times.get(send, 0)) for times in items.values()]


def flow_shop_lower_bound(times: Sequence[Sequence[float]]) -> float:
    """The flow-shop makespan lower bound of docs/internals/pipeline.md.

    ``times[k][s]`` is item k's duration in stage s (stages in pipeline order).
    """
    if not times:
        return 0.0
    stages = len(times[0])
    bound = 0.0
    for s in range(stages):
        total = sum(t[s] for t in times)
        head = min(sum(t[:s]) for t in times)
        tail = min(sum(t[s + 1 :]) for t in times)
        bound = max(bound, total + head + tail)
    return bound


@dataclass(frozen=True)
class PipelineMetrics:
    items: int
    makespan_ns: int
    lower_bound_ns: float
    busy_ns: dict[str, int]
    hidden_comm_fraction: float

    @property
    def efficiency(self) -> float:
        """lower bound / makespan (1.0 = as fast as any schedule could be)."""
        return fraction(self.lower_bound_ns, self.makespan_ns)

    def as_dict(self) -> dict[str, object]:
        return {
            "items": self.items,
            "makespan_ms": self.makespan_ns / 1e6,
            "lower_bound_ms": self.lower_bound_ns / 1e6,
            "efficiency": self.efficiency,
            "hidden_comm_fraction": self.hidden_comm_fraction,
            "busy_ms": {k: v / 1e6 for k, v in self.busy_ns.items()},
        }


def compute_metrics(spans: Sequence[Span]) -> PipelineMetrics:
    times = stage_times(spans)
    return PipelineMetrics(
        items=len(times),
        makespan_ns=makespan_ns(spans),
        lower_bound_ns=flow_shop_lower_bound(times),
        busy_ns=busy_ns(spans),
        hidden_comm_fraction=hidden_comm_fraction(spans),
    )
