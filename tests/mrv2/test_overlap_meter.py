"""The Attention side's overlap meter (:mod:`afd_mrv2.mrv2.attention.overlap`) on the executor's interval
arithmetic: a round trip's hidden part is its overlap with the other micro-batches' compute."""

from __future__ import annotations

import random

import pytest

from afd_mrv2.mrv2.attention.overlap import OverlapMeter


def hidden_brute_force(start: int, end: int, others: list[tuple[int, int]]) -> int:
    """ns of ``[start, end)`` inside at least one of ``others``, counted one ns at a time."""
    return sum(1 for t in range(start, end) if any(a <= t < b for a, b in others))


def test_hidden_time_is_the_overlap_with_the_other_micro_batches_compute_on_random_steps() -> None:
    rng = random.Random(3)
    meter, expected_hidden, expected_total = OverlapMeter(), 0, 0
    for _ in range(60):
        computes = [(rng.randint(0, 2), s, s + rng.randint(0, 40)) for s in (rng.randint(0, 200) for _ in range(6))]
        round_trips = [(rng.randint(0, 2), s, s + rng.randint(0, 80)) for s in (rng.randint(0, 200) for _ in range(3))]
        for u, s, e in computes:
            meter.compute(u, s, e)
        for u, s, e in round_trips:
            meter.round_trip(u, s, e)
            expected_hidden += hidden_brute_force(s, e, [(a, b) for v, a, b in computes if v != u])
            expected_total += e - s
        meter.end_step(3)
    figures = meter.snapshot()["3"]
    assert figures["hidden_total_ms"] == pytest.approx(expected_hidden / 1e6)
    assert figures["hidden_fraction"] == pytest.approx(expected_hidden / expected_total)
    assert meter.totals_s() == pytest.approx((expected_total / 1e9, expected_hidden / 1e9))


def test_an_unsplit_step_hides_nothing_and_totals_add_every_stage_count() -> None:
    meter = OverlapMeter()
    meter.compute(0, 0, 500)  # its own compute: never hides its own round trip
    meter.round_trip(0, 100, 1100)
    meter.end_step(1)
    meter.compute(1, 1000, 1300)
    meter.round_trip(0, 1000, 2000)
    meter.end_step(2)
    snapshot = meter.snapshot()
    assert snapshot["1"]["hidden_fraction"] == 0.0 and snapshot["2"]["hidden_fraction"] == 0.3
    assert meter.totals_s() == pytest.approx((2000 / 1e9, 300 / 1e9))
    assert OverlapMeter().totals_s() == (0.0, 0.0) and OverlapMeter().snapshot() == {}
