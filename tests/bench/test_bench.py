"""Micro-benchmarks (marker ``bench``, deselected by default): ``pytest -m bench``.

The measurement itself is checked on every run (no marker): it counts the items it
timed through every hook and derives its figure from its own wall time.
"""

from __future__ import annotations

import statistics

import pytest

from afd_mrv2.bench.overhead import Overhead, measure


def _check(run: Overhead, items: int) -> None:
    assert run.items == items
    assert run.calls == {"recv": items, "compute": items, "send": items}  # every item through every hook
    assert run.wall_s > 0 and run.per_item_us == pytest.approx(run.wall_s / items * 1e6, rel=1e-12)


@pytest.mark.bench
@pytest.mark.parametrize("backend", ["recording", "host"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serialized", "pipelined"])
def test_executor_overhead_per_item(benchmark, backend: str, pipelined: bool) -> None:  # type: ignore[no-untyped-def]
    runs: list[Overhead] = []

    def once() -> float:
        runs.append(measure(backend, pipelined=pipelined, items=1000))
        return runs[-1].per_item_us

    us = benchmark.pedantic(once, rounds=5)
    benchmark.extra_info["us_per_item"] = us
    assert len(runs) == 5 and us == runs[-1].per_item_us
    for run in runs:
        _check(run, 1000)
        assert (run.backend, run.pipelined) == (backend, pipelined)
    # each figure is timed inside the call the benchmark timed (which adds start-up and close)
    rounds = benchmark.stats.stats.data
    assert len(rounds) == 5 and all(run.wall_s <= t for run, t in zip(runs, rounds, strict=True))


@pytest.mark.parametrize("backend", ["recording", "host"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serialized", "pipelined"])
def test_overhead_measurement_counts_every_item_through_every_hook(backend: str, pipelined: bool) -> None:
    _check(measure(backend, pipelined=pipelined, items=50), 50)


def test_pipelined_host_costs_more_per_item_than_the_recording_backend() -> None:
    """Three threads handing each item over through events vs. inline calls: about 5x apart, asserted 1x."""
    host = statistics.median(measure("host", pipelined=True, items=300).per_item_us for _ in range(3))
    recording = statistics.median(measure("recording", pipelined=True, items=300).per_item_us for _ in range(3))
    assert host > recording, (host, recording)
