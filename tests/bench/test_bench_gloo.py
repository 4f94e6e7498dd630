"""``afd-mrv2 bench --link gloo``: the depth sweep on the embedded deployment."""

from __future__ import annotations

import json

import pytest

from afd_mrv2.cli import main


def test_bench_gloo_json(capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--link", "gloo", "--depths", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["link"] == "gloo"
    modes = [(m["mode"], m["depth_in"], m["depth_out"]) for m in result["modes"]]
    assert modes == [("serialized", 1, 1), ("pipelined", 2, 2)]
    for mode in result["modes"]:
        assert mode["max_abs_diff"] <= 1e-5
        assert mode["per_layer_ms"] > 0 and 0 < mode["efficiency"] <= 1.05
        buffers = mode["buffers"]
        assert (buffers["in"], buffers["out"]) == (mode["depth_in"], mode["depth_out"])
        assert {"attention 0", "attention 1", "ffn 0"} == set(buffers["by_rank"])
        assert buffers["bytes"] == max(r["bytes"] for r in buffers["by_rank"].values()) > 0
    serial, piped = (m["buffers"]["by_rank"]["ffn 0"] for m in result["modes"])
    assert piped["input_bytes"] == serial["input_bytes"] * 2 and piped["output_bytes"] == serial["output_bytes"] * 2
    assert (tmp_path / "out/bench-gloo/trace.json").is_file()
