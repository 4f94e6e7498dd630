"""scripts/bench_wake.py: its input contract, its report, and one tiny real run (two pinned processes on a
tcp pair, every AFD_MRV2_TCP_SPIN mode)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.probe.test_bench_serve import load

bench = load("bench_wake")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "fast"], "--modes: each of off, short, on, got fast"),
        (["--iters", "0"], "--iters must be >= 1, got 0"),
        (["--ffn-ms", "-1"], "must be >= 0"),
        (["--cores", "0,0"], "--cores: two different cores"),
        (["--cores", "x"], "--cores: two core numbers A,F, got 'x'"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_wake: error: ") and message in err


def test_report_prints_each_mode_and_its_p50_against_the_first() -> None:
    row = {"dispatch_p50_us": 100.0, "dispatch_p90_us": 200.0, "combine_p50_us": 150.0, "combine_p90_us": 300.0}
    cpu = {"attention_cpu_ms_per_trip": 2.5, "ffn_cpu_ms_per_trip": 5.25}
    summary = {"off": {**row, **cpu}, "on": {**row, "dispatch_p50_us": 60.0, "combine_p50_us": 120.0, **cpu}}
    args = bench.parse(["--cores", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])])
    lines = bench.report(args, summary).splitlines()
    assert lines[2].split() == ["off", "100", "200", "150", "300", "2.500", "5.250"]
    assert lines[4] == "on / off at p50: dispatch 0.60, combine 0.80"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")  # CI has two
def test_a_tiny_run_measures_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "wake.json"
    argv = ["--iters", "30", "--warmup", "3", "--rounds", "1", "--attention-ms", "1", "--ffn-ms", "2"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["off", "short", "on"]
    for row in modes.values():
        # a delivery is more than nothing and far less than a compute period; each side computed its ms per trip
        assert 0 < row["dispatch_p50_us"] < 50_000 and 0 < row["combine_p50_us"] < 50_000, row
        assert row["attention_cpu_ms_per_trip"] >= 0.5 and row["ffn_cpu_ms_per_trip"] >= 1.0, row
    assert "on / off at p50" in capsys.readouterr().out
