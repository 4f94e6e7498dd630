"""The simulated-link connector and the overlap demo built on it."""

from __future__ import annotations

import json

import pytest
import torch

from afd_mrv2.cli import main
from afd_mrv2.errors import ConfigError
from afd_mrv2.hooks.simlink import LinkModel


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
    torch.set_num_threads(1)
    trace = tmp_path / "demo.json"
    assert main(["demo", "--items", "12", "--depth", "3", "--phase-ms", "4", "--json", "--trace", str(trace)]) == 0
    result = json.loads(capsys.readouterr().out)
    serial, piped = result["modes"]
    assert serial["mode"] == "serialized" and piped["mode"] == "pipelined d=3"
    assert serial["max_abs_diff"] == piped["max_abs_diff"] == 0.0
    assert piped["speedup"] > 1.15  # ideal 2.6x at 12 items; loose: compute is real matmul on a shared machine
    assert 0 < piped["efficiency"] <= 1.05
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


def test_demo_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--items", "4", "--depth", "2", "--phase-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert "serialized" in out and "pipelined d=2" in out and "efficiency" in out
