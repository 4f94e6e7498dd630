"""Micro-benchmarks (marker ``bench``, deselected by default): ``pytest -m bench``."""

from __future__ import annotations

import pytest

from afd_mrv2.bench.overhead import per_item_us


@pytest.mark.bench
@pytest.mark.parametrize("backend", ["recording", "host"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serialized", "pipelined"])
def test_executor_overhead_per_item(benchmark, backend: str, pipelined: bool) -> None:  # type: ignore[no-untyped-def]
    us = benchmark.pedantic(per_item_us, args=(backend,), kwargs={"pipelined": pipelined, "items": 1000}, rounds=5)
    benchmark.extra_info["us_per_item"] = us
    assert us > 0
