"""The hidden-communication metric stays exact and fast on long traces (foundation change for issue 3)."""

from __future__ import annotations

import itertools
import random
import time

from afd_mrv2.devices.base import Span
from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline.metrics import fraction, hidden_comm_fraction, overlap, union


def brute_force(interval: tuple[int, int], merged: list[tuple[int, int]]) -> int:
    start, end = interval
    return sum(max(0, min(end, b) - max(start, a)) for a, b in merged)


def test_overlap_matches_brute_force_on_random_intervals() -> None:
    rng = random.Random(0)
    for _ in range(200):
        merged = union((s, s + rng.randint(0, 30)) for s in (rng.randint(0, 500) for _ in range(rng.randint(0, 20))))
        for _ in range(20):
            a = rng.randint(-20, 540)
            interval = (a, a + rng.randint(0, 60))
            assert overlap(interval, merged) == brute_force(interval, merged)


def test_union_is_sorted_and_disjoint_and_covers_the_same_points() -> None:
    rng = random.Random(1)
    for _ in range(200):
        intervals = [(s, s + rng.randint(0, 30)) for s in (rng.randint(0, 300) for _ in range(rng.randint(0, 15)))]
        merged = union(intervals)
        assert all(a <= b < c for (a, b), (c, _) in itertools.pairwise(merged))  # sorted, disjoint
        points = {p for a, b in intervals for p in range(a, b)}
        assert {p for a, b in merged for p in range(a, b)} == points


def test_fraction_is_zero_until_something_was_measured() -> None:
    assert fraction(1, 4) == 0.25 and fraction(3, 3) == 1.0
    assert fraction(0, 0) == 0.0 and fraction(5, 0) == 0.0


def test_hidden_fraction_of_a_long_trace_is_quick() -> None:
    spans, t = [], 0
    for k in range(5000):
        for name in ("recv", "compute", "send"):
            spans.append(Span(name, name, 1, WorkItem(0, 0, k), (0, 0), t, t + 1000))
            t += 700
    start = time.perf_counter()
    assert abs(hidden_comm_fraction(spans) - 0.3) < 1e-9
    assert time.perf_counter() - start < 2.0  # was ~15 s with the quadratic scan
