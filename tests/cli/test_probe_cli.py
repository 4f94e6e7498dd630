"""``afd-mrv2 probe npu``: without an NPU it exits 3 with a clear message and writes every row skipped."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types

import pytest
import torch

from afd_mrv2.cli import main
from afd_mrv2.cli.probe import EXIT_NO_NPU
from afd_mrv2.hooks.cam.evidence import Evidence, Report, StreamBehaviour, validate
from afd_mrv2.probe import npu as probe_npu


def test_console_script_without_npu(tmp_path) -> None:
    out = tmp_path / "evidence.json"
    exe = shutil.which("afd-mrv2") or sys.executable
    cmd = (
        [exe, "probe", "npu", "--out", str(out)]
        if exe != sys.executable
        else [exe, "-m", "afd_mrv2.cli", "probe", "npu", "--out", str(out)]
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_NO_NPU
    assert "afd-mrv2 probe npu: no usable Ascend NPU: torch_npu is not installed" in done.stderr
    assert f"every check skipped (written to {out})" in done.stderr
    raw = json.loads(out.read_text())
    assert validate(raw) == [] and raw["producer"] == "afd-mrv2 probe npu"
    assert raw["summary"]["pass"] == raw["summary"]["fail"] == 0 and raw["summary"]["skipped"] > 0
    assert all(c["detail"].startswith("skipped: no NPU: torch_npu is not installed") for c in raw["checks"])
    # a connector given this document keeps every operator unverified: nothing was established
    evidence = Evidence.load(out)
    assert evidence.operators and all(op.stream is StreamBehaviour.UNVERIFIED for op in evidence.operators.values())


def fake_importlib(import_module) -> types.SimpleNamespace:
    """Stands in for the probe module's ``importlib``: torch_npu is "installed"."""
    return types.SimpleNamespace(
        util=types.SimpleNamespace(find_spec=lambda name: object()), import_module=import_module
    )


def test_torch_npu_that_does_not_import(monkeypatch, capsys, tmp_path) -> None:
    def broken(name: str):
        raise OSError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(probe_npu, "importlib", fake_importlib(broken))
    assert main(["probe", "npu", "--out", str(tmp_path / "e.json")]) == EXIT_NO_NPU
    assert "torch_npu does not import (OSError: libhccl.so" in capsys.readouterr().err


def test_too_few_npus(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(probe_npu, "importlib", fake_importlib(types.ModuleType))
    monkeypatch.setattr(
        torch, "npu", types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1), raising=False
    )
    assert main(["probe", "npu", "--out", str(tmp_path / "e.json")]) == EXIT_NO_NPU
    assert "needs 2 NPUs (one attention rank, one FFN rank); torch.npu sees 1" in capsys.readouterr().err


def test_bad_arguments() -> None:
    with pytest.raises(SystemExit, match="--window-ms must be > 0"):
        main(["probe", "npu", "--window-ms", "0"])


@pytest.mark.npu
def test_probe_on_two_npus(tmp_path) -> None:
    """Hardware owners: ``pytest -m npu tests/cli``.  Fails loudly where there is no NPU."""
    path = probe_npu.run_probe(tmp_path / "evidence.json")
    evidence = Evidence.load(path)
    assert all(op.present for op in evidence.operators.values())
    assert all(op.stream is not StreamBehaviour.UNVERIFIED for op in evidence.operators.values())
    for result in evidence.comparisons.values():
        assert result.get("equal") is True, result
    report = Report.load(path)
    assert {c.name: c.status for c in report.checks if c.status != "pass"} == {}
