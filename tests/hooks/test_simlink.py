"""The simulated-link connector and the overlap demo built on it."""

from __future__ import annotations

import json

import pytest
import torch

from afd_mrv2.cli import main
from afd_mrv2.errors import ConfigError
from afd_mrv2.hooks.simlink import LinkModel
from afd_mrv2.reference.buffer_report import buffers_cell, format_bytes


def test_link_model_cost_is_latency_plus_bytes_over_bandwidth() -> None:
    link = LinkModel.from_options({"latency_us": 100, "bandwidth_gbps": 1})
    assert link.cost_s("recv", 1_000_000) == pytest.approx(100e-6 + 1e-3)
    asym = LinkModel.from_options({"recv_latency_us": 10, "send_latency_us": 30, "bandwidth_gbps": 0})
    assert asym.cost_s("recv", 10**9) == pytest.approx(10e-6)
    assert asym.cost_s("send", 10**9) == pytest.approx(30e-6)


@pytest.mark.parametrize(
    ("options", "key"),
    [({"latency": 1}, "latency"), ({"latency_us": -1}, "latency_us"), ({"bandwidth_gbps": "fast"}, "bandwidth_gbps")],
)
def test_bad_link_options_name_the_key(options: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        LinkModel.from_options(options)
    assert info.value.key == f"afd.connector_extra_config.{key}"


def test_demo_json_reports_identical_outputs_and_a_speedup(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Correctness and the report's shape: how much faster the pipelined mode runs depends on the machine's
    load, so that figure is checked by a benchmark (tests/bench/test_bench_speedups.py, ``-m bench``)."""
    torch.set_num_threads(1)
    trace = tmp_path / "demo.json"
    assert main(["demo", "--items", "12", "--depths", "3", "--phase-ms", "4", "--json", "--trace", str(trace)]) == 0
    result = json.loads(capsys.readouterr().out)
    serial, piped = result["modes"]
    assert serial["mode"] == "serialized" and piped["mode"] == "pipelined 3in/3out"
    assert serial["max_abs_diff"] == piped["max_abs_diff"] == 0.0
    assert serial["speedup"] == 1.0 and piped["speedup"] > 0  # the serialized mode's wall time over this one's
    assert 0 < piped["efficiency"] <= 1.05
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


def test_demo_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--items", "4", "--depths", "2", "--phase-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert "serialized" in out and "pipelined 2in/2out" in out and "efficiency" in out
    assert "buffers (in+out)" in out


def _simlink_slot_bytes() -> int:
    """One simlink buffer, computed apart from the measurement: the demo's item is a float32 [ROWS, WIDTH]."""
    from afd_mrv2.bench.overlap import ROWS, WIDTH

    return ROWS * WIDTH * torch.tensor([], dtype=torch.float32).element_size()


def test_demo_reports_the_bytes_its_buffers_hold_in_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    """depth_in input + depth_out output buffers of one item's tensor each; table and JSON agree."""
    args = ["demo", "--items", "6", "--phase-ms", "0.5", "--depths", "2", "--buffers", "3", "1"]
    assert main([*args, "--json"]) == 0
    modes = json.loads(capsys.readouterr().out)["modes"]
    slot = _simlink_slot_bytes()
    assert [(m["mode"], m["buffers"]["in"], m["buffers"]["out"]) for m in modes] == [
        ("serialized", 1, 1),
        ("pipelined 2in/2out", 2, 2),
        ("pipelined 3in/1out", 3, 1),
    ]
    for m in modes:
        b = m["buffers"]
        assert b["input_bytes"] == [slot] * b["in"] and b["output_bytes"] == [slot] * b["out"]
        assert b["bytes"] == (b["in"] + b["out"]) * slot
    assert main(args) == 0
    table = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert "1+1 / 128 KiB" in lines["serialized"]  # 64 x 256 float32 = 64 KiB per buffer
    for m in modes:
        assert buffers_cell(m["buffers"]) in lines[m["mode"]]
    assert buffers_cell(modes[2]["buffers"]) == "3+1 / 256 KiB"


def test_format_bytes_and_cells() -> None:
    assert [format_bytes(n) for n in (96, 65536, 1_363_149, 3 * 2**30)] == ["96 B", "64 KiB", "1.3 MiB", "3 GiB"]
    auto = {"in": 2, "out": 1, "bytes": 6 * 2**16, "input_bytes": [2**16] * 3 + [0] * 5, "output_bytes": [2**16] * 3}
    assert buffers_cell(auto) == "2+1 (3+3 held) / 384 KiB"
