"""``afd-mrv2 probe ascend`` on a machine without Ascend (its document), and its verdicts on made-up results.

The registration child itself runs on the CPU vehicle (tests/ascend_vehicle/test_registration.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from afd_mrv2.hooks.cam.evidence import Report, validate
from afd_mrv2.probe import ascend
from afd_mrv2.probe.ascend import ADAPTER, ROW_NAMES, W8A8_ROWS, identity_rows, is_w8a8, registration_verdict

ASCEND_LAYER = "vllm_ascend.ops.fused_moe.routed_experts.AscendRoutedExperts"


def test_without_vllm_ascend_every_row_is_skipped_and_the_exit_is_3(tmp_path: Path) -> None:
    out = tmp_path / "evidence.json"
    done = subprocess.run(
        [sys.executable, "-m", "afd_mrv2.cli", "probe", "ascend", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert "vllm-ascend is not installed" in done.stderr and str(out) in done.stderr
    doc = json.loads(out.read_text())
    assert validate(doc) == [] and doc["producer"] == "afd-mrv2 probe ascend"
    assert [c["name"] for c in doc["checks"]] == [*ROW_NAMES, *W8A8_ROWS]
    assert {c["status"] for c in doc["checks"]} == {"skipped"}
    assert doc["summary"] == {"pass": 0, "fail": 0, "skipped": 6}


def _registry(routed: str, bases: list[str]) -> dict[str, object]:
    return {
        "steps": ["plugins", "ascend", "afd"],
        "registry": {"RoutedExperts": routed, "MoERunner": "x"},
        "routed_experts_bases": bases,
    }


def test_registration_passes_only_for_the_adapter_over_vllm_ascends_layer() -> None:
    ok = registration_verdict(_registry(ADAPTER, [ASCEND_LAYER, "vllm.RoutedExperts"]), "")
    assert ok.status == "pass" and ok.measured["over"] == ASCEND_LAYER
    not_installed = registration_verdict(_registry(ASCEND_LAYER, ["vllm.RoutedExperts"]), "")
    assert not_installed.status == "fail" and ASCEND_LAYER in not_installed.detail
    failed = {
        "steps": ["plugins"],
        "failed": {"step": "ascend", "type": "AssertionError", "message": "Duplicate"},
        "registry": {},
    }
    assert registration_verdict(failed, "").detail == "step ascend failed: Duplicate"
    silent = registration_verdict(None, "Traceback ...\nImportError: torch_npu")
    assert silent.status == "fail" and "ImportError: torch_npu" in silent.detail


def test_identity_rows_need_every_completion_identical_and_an_ffn_item() -> None:
    plain = [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 5], [-0.4, -0.5])]
    step, same = identity_rows("float", plain, list(plain), ffn_items=12)
    assert (step.status, same.status) == ("pass", "pass") and same.measured["identical"] == 2
    _, differs = identity_rows("float", plain, [plain[0], ([4, 6], [-0.4, -0.6])], ffn_items=12)
    assert differs.status == "fail" and differs.detail == "1/2 greedy completions identical"
    no_afd, _ = identity_rows("w8a8", plain, list(plain), ffn_items=0)
    assert no_afd.name == "ascend:afd-step:w8a8" and no_afd.status == "fail"


def test_w8a8_is_read_from_the_modelslim_description(tmp_path: Path) -> None:
    assert "quant_model_description.json is missing" in (is_w8a8(tmp_path) or "")
    (tmp_path / "quant_model_description.json").write_text(json.dumps({"model.embed_tokens.weight": "FLOAT"}))
    assert "no W8A8 layer" in (is_w8a8(tmp_path) or "")
    (tmp_path / "quant_model_description.json").write_text(
        json.dumps({"model_quant_type": "W8A8_DYNAMIC", "model.layers.0.mlp.experts.0.w1.weight": "W8A8_DYNAMIC"})
    )
    assert is_w8a8(tmp_path) is None


def test_a_refused_runtime_skips_the_serving_rows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No server is started when the pair is refused: those rows say which row failed."""
    monkeypatch.setattr(ascend, "missing", lambda: None)
    monkeypatch.setattr(ascend, "runtime_row", lambda: ascend.Check("ascend:runtime", "fail", None, "refused"))
    monkeypatch.setattr(ascend, "registration_row", lambda: ascend.Check("ascend:registration", "pass", {}, ""))
    report = ascend.run_probe(ascend.ProbeSpec(tmp_path / "model", None, tmp_path / "logs"))
    assert isinstance(report, Report) and report.failed
    rows = {c.name: (c.status, c.detail) for c in report.checks}
    assert rows["ascend:token-identity:float"] == ("skipped", "skipped: ascend:runtime failed")
    assert validate(report.to_json()) == []
