"""How much of the Attention side's FFN round trips ran under another micro-batch's compute.

:class:`OverlapMeter` (``end_step``, ``snapshot``, ``hidden_fraction``).

See docs/internals/micro-batching.md, "afd_mrv2.mrv2.attention.overlap".
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from afd_mrv2.pipeline.metrics import fraction, overlap, union


@dataclass
class _Totals:
    steps: int = 0
    round_trips: int = 0
    round_trip_ns: int = 0
    hidden_ns: int = 0
    computes: int = 0
    compute_ns: int = 0

    def add_step(self, step: _Step) -> None:
        """Fold one step's spans in (see docs/internals/micro-batching.md)."""
        self.steps += 1
        for ubatch, start, end in step.round_trips:
            others = [(s, e) for u, s, e in step.computes if u != ubatch]
            self.round_trips += 1
            self.round_trip_ns += end - start
            self.hidden_ns += overlap((start, end), union(others))
        for _, start, end in step.computes:
            self.computes += 1
            self.compute_ns += end - start


@dataclass
class _Step:
    round_trips: list[tuple[int, int, int]] = field(default_factory=list)  # (ubatch, start, end)
    computes: list[tuple[int, int, int]] = field(default_factory=list)


class OverlapMeter:
    """Round-trip and compute spans of the current step, and cumulative overlap counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step = _Step()
        self._totals: dict[int, _Totals] = defaultdict(_Totals)

    def round_trip(self, ubatch: int, start_ns: int, end_ns: int) -> None:
        with self._lock:
            self._step.round_trips.append((ubatch, start_ns, end_ns))

    def compute(self, ubatch: int, start_ns: int, end_ns: int) -> None:
        with self._lock:
            self._step.computes.append((ubatch, start_ns, end_ns))

    def end_step(self, num_stages: int) -> None:
        """Fold the spans recorded since the last call into the counters of ``num_stages``."""
        with self._lock:
            step, self._step = self._step, _Step()
            totals = self._totals[num_stages]
        if step.round_trips or step.computes:
            totals.add_step(step)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per stage count: steps, round trips and their total/hidden ms, compute spans and their total ms,
        ``hidden_fraction``, ``round_trip_ms`` and ``compute_ms`` (means per span)."""
        with self._lock:
            items = sorted(self._totals.items())
        out: dict[str, dict[str, Any]] = {}
        for stages, t in items:
            out[str(stages)] = {
                "steps": t.steps,
                "round_trips": t.round_trips,
                "round_trip_total_ms": t.round_trip_ns / 1e6,
                "hidden_total_ms": t.hidden_ns / 1e6,
                "computes": t.computes,
                "compute_total_ms": t.compute_ns / 1e6,
                "hidden_fraction": fraction(t.hidden_ns, t.round_trip_ns),
                "round_trip_ms": t.round_trip_ns / t.round_trips / 1e6 if t.round_trips else 0.0,
                "compute_ms": t.compute_ns / t.computes / 1e6 if t.computes else 0.0,
            }
        return out

    def totals_s(self) -> tuple[float, float]:
        """Round-trip seconds and their hidden seconds so far, all stage counts together (the live figures'
        ``round_trip_total_s`` and ``hidden_total_s``)."""
        with self._lock:
            totals = list(self._totals.values())
        return sum(t.round_trip_ns for t in totals) / 1e9, sum(t.hidden_ns for t in totals) / 1e9
