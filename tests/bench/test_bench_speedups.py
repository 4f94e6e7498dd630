"""How much faster the pipelined modes run (marker ``bench``, deselected by default): ``pytest -m bench -s``.

A speedup depends on what else the machine runs, so it is a benchmark, never a unit test: the unit
tests (tests/hooks/test_simlink.py, tests/reference/test_run_e2e.py) check that these runs compute the
same numbers in every mode and that their traces overlap; these print the ratios and check them
against loose floors, on a quiet machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from afd_mrv2.cli import main
from tests.reference.test_run_e2e import run_json

pytestmark = pytest.mark.bench


def _print_modes(what: str, modes: list[dict[str, Any]]) -> None:
    print(f"\n{what}: " + "; ".join(f"{m['mode']} speedup {m['speedup']:.2f}x" for m in modes), flush=True)


def test_demo_pipelined_speedup_on_the_simulated_link(benchmark, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """``afd-mrv2 demo``, 12 items, depth 3, 4 ms phases: ideal 2.6x; the floor is loose (compute is real matmul)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = benchmark.pedantic(
            main, args=(["demo", "--items", "12", "--depths", "3", "--phase-ms", "4", "--json"],), rounds=1
        )
    finally:
        torch.set_num_threads(previous)
    assert code == 0
    serial, piped = json.loads(capsys.readouterr().out)["modes"]
    benchmark.extra_info["speedup"] = piped["speedup"]
    with capsys.disabled():
        _print_modes("afd-mrv2 demo (12 items, 4 ms phases)", [serial, piped])
    assert piped["speedup"] > 1.15


def test_run_multistream_speedup_on_the_simulated_link(benchmark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``afd-mrv2 run --link sim --sim-latency-us 3000``: the simulated link dominates, ideal 3x."""
    report = benchmark.pedantic(run_json, args=(tmp_path, "--link", "sim", "--sim-latency-us", "3000"), rounds=1)
    assert report["ok"] is True
    benchmark.extra_info["speedup"] = report["speedup"]
    _print_modes("afd-mrv2 run --link sim (3 ms per transfer)", report["modes"])
    assert report["speedup"] > 1.2, report["modes"]
