"""scripts/bench_replicas.py without vLLM: its input contract and its report (the two-sided run itself needs
vLLM; docs/benchmarks-vllm.md holds a measured one)."""

from __future__ import annotations

import pytest

from tests.probe.test_bench_serve import load

replicas = load("bench_replicas")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/m", "--compare", "nope"], "invalid choice"),
        (["/m", "--compare", "transport"], "invalid choice"),  # removed with the one-group transport
        (["/m", "--compare", "replicas", "--ffn", "0"], "--ffn must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        replicas.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_comparison_changes_one_thing_and_is_the_default() -> None:
    (_, flags), (_, other_flags) = replicas.COMPARISONS["replicas"]
    assert (flags, other_flags) == ((), ("--expert-replicas", "2"))
    assert list(replicas.COMPARISONS) == ["replicas"]
    assert replicas.parse_args(["/m"])[0].compare == "replicas"


def test_report_prints_medians_the_ratio_and_the_expert_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    result = {
        "sides": ["R1", "R2"],
        "summary": {
            "R1": {"median_tok_s": 100.0, "median_forward_ms": 10.0, "tok_s": [99.0, 100.0, 101.0]},
            "R2": {"median_tok_s": 98.0, "median_forward_ms": 10.5, "tok_s": [97.0, 98.0, 99.0]},
        },
        "ratios": {"R2/R1 tok_s": 0.98, "R2/R1 forward_ms": 1.05},
        "expert_memory": {
            "R1": {"0": {"held_bytes": 1000, "read_bytes": 1000, "peak_rss_bytes": 5000}},
            "R2": {"0": {"held_bytes": 2000, "read_bytes": 2000, "peak_rss_bytes": None}},
        },
        "load_average": {"start": (1.0, 1.0, 1.0), "end": (2.0, 1.0, 1.0)},
    }
    replicas.report(result)
    out = capsys.readouterr().out
    assert "R2/R1 tok_s: 0.980" in out and "R2/R1 forward_ms: 1.050" in out
    assert "R1 FFN rank 0: routed-expert bytes held 1,000, read 1,000; peak RSS 5,000 B" in out
    assert "R2 FFN rank 0: routed-expert bytes held 2,000, read 2,000; peak RSS n/a B" in out
