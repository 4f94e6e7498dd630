"""scripts/bench_transport.py: its report, its input contract, and one tiny real run (two pinned processes, a
socket and torch_p2p's hooks on a gloo pair)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.probe.test_bench_serve import load

bench = load("bench_transport")


def _row(size: int, socket: tuple[float, float, float], hooks: tuple[float, float, float]) -> dict:
    stats = ("p50", "mean", "p99")
    return {
        "size_kib": size,
        "socket_us": dict(zip(stats, socket, strict=True)),
        "hooks_us": dict(zip(stats, hooks, strict=True)),
        "breakdown_median_us": {name: float(i + 1) for i, name in enumerate(bench.SPANS)},
    }


def test_report_prints_both_paths_their_ratios_and_the_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    result = {
        "transport": "gloo",
        "iters": 2000,
        "rows": [
            _row(16, (50.0, 100.0, 900.0), (150.0, 150.0, 400.0)),
            _row(256, (100.0, 200.0, 1.0), (180.0, 90.0, 1.0)),
        ],
    }
    bench.report(result)
    lines = capsys.readouterr().out.splitlines()
    sixteen, two56 = ([line.split() for line in lines if line.split()[:1] == [size]] for size in ("16", "256"))
    # the first table: size, socket p50 / mean / p99, hooks p50 / mean / p99, hooks/socket at p50 and at mean
    assert sixteen[0] == ["16", "50.0", "100.0", "900.0", "150.0", "150.0", "400.0", "3.0", "1.5"]
    assert two56[0][7:] == ["1.8", "0.5"]
    # the second: size, the hooks' p50 round trip, then the span medians in order
    header = next(line for line in lines if "FFN wake-up" in line)
    assert header.split()[:3] == ["KiB", "round", "trip"] and "take  pack  post  wire out" in header
    assert sixteen[1] == ["16", "150.0", *[f"{i + 1:.1f}" for i in range(len(bench.SPANS))]]


def test_the_spans_follow_each_other_and_add_up_to_the_round_trip() -> None:
    a = {"start": [0.0], "pack0": [1.0], "pack1": [3.0], "send0": [4.0], "combine_done": [20.0], "waited": [22.0]}
    a["end"] = [25.0]
    f = {"payload_done": [8.0], "compute0": [11.0], "compute1": [12.0], "combine_send": [14.0]}
    spans = bench.spans(a, f)
    assert list(spans) == list(bench.SPANS)
    assert {name: v[0] for name, v in spans.items()} == {
        "take": 1.0,
        "pack": 2.0,
        "post": 1.0,
        "wire out": 4.0,
        "FFN wake-up": 3.0,
        "FFN compute": 1.0,
        "FFN pack": 2.0,
        "wire back": 6.0,
        "A wake-up": 2.0,
        "unpack": 3.0,
    }
    assert sum(v[0] for v in spans.values()) == 25.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cores", "0"], "--cores: expected two different cores such as 0,1, got '0'"),
        (["--cores", "1,1"], "--cores: expected two different cores"),
        (["--sizes", "16,x"], "--sizes: expected positive whole KiB such as 16,64,256, got '16,x'"),
        (["--sizes", "0"], "--sizes: expected positive whole KiB"),
        (["--iters", "0"], "--iters must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], signals_restored: None
) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_transport: error: ") and message in err


def test_one_allowed_core_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signals_restored: None
) -> None:
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {3})
    assert bench.main(["--sizes", "16"]) == 2
    err = capsys.readouterr().err
    assert err == "bench_transport: error: needs two cores to pin its two processes to, this process may run on [3]\n"


def test_a_tiny_real_run_measures_both_paths_and_every_span(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signals_restored: None
) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--iters", "50", "--warmup", "5", "--sizes", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["transport"] == "gloo" and len(result["cores"]) == 2 and result["torch"]
    (row,) = result["rows"]
    assert row["size_kib"] == 16 and row["dispatch_bytes"] == 16384
    for path in ("socket_us", "hooks_us"):
        assert 0 < row[path]["p50"] <= row[path]["p99"] and row[path]["mean"] > 0
    assert list(row["breakdown_median_us"]) == list(bench.SPANS)
    assert all(value > 0 for value in row["breakdown_median_us"].values()), row["breakdown_median_us"]
    assert row["ratios"]["p50"] == pytest.approx(row["hooks_us"]["p50"] / row["socket_us"]["p50"])
    assert "hooks/socket p50" in capsys.readouterr().out
