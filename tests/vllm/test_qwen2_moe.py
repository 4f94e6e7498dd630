"""A third architecture through AFD in a real vLLM: Qwen2-MoE, 1A1F against plain vLLM.

Run (deselected by default)::

    .venv-vllm/bin/python -m pytest -m vllm_runtime tests/vllm/test_qwen2_moe.py -x -s

What each architecture exercises on the vLLM path (``afd-mrv2 make-model`` checkpoints,
real seeded fp32 weights, ``afd_mrv2/checkpoints/archs.py``):

* mixtral (test_afd_in_vllm.py, test_serve.py): routed experts only, top-k weights
  renormalized; plain attention;
* deepseek_v2 (test_afd_in_vllm.py): MLA attention, one UNGATED shared expert (run on
  the Attention side by vLLM's MoE runner, added to the remote routed output), raw
  top-k softmax weights (``norm_topk_prob: false``);
* qwen2_moe (here): a shared expert WITH its own sigmoid gate (``shared_expert_gate``,
  Attention side), raw top-k weights (``norm_topk_prob: false``: the FFN must apply the
  un-renormalized weights it is sent), q/k/v attention biases.

Engines (module scope, tests/vllm/harness.py): the FFN role (core 1) starts, and while
it does ``plain`` (afd-mrv2 installed, no ``afd`` section, core 0) and ``zero`` (TEST
ONLY switch: routed experts give zeros, core 1) run; then the Attention engine (core 0,
role ``attention``) against the FFN role.  Sixteen prompts, 12 greedy tokens each, V1 runner, compiled.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.serve.conftest import free_port_block
from tests.vllm.harness import (
    EngineRun,
    FfnRole,
    afd_section,
    assert_experts_on_ffn_and_every_call_served,
    assert_identical,
    compare,
    cores,
    make_model,
    run_engines,
    zero_env,
)

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1800)]

ARCH = "qwen2_moe"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp(f"vllm-{ARCH}")
    model = make_model(folder / "model", ARCH)
    config = json.loads((model / "config.json").read_text())
    assert config["norm_topk_prob"] is False and config["shared_expert_intermediate_size"] > 0, config
    attention_core, ffn_core = cores()
    port = free_port_block(1)
    ffn = FfnRole(model, afd_section("ffn", port), folder / "ffn.log", ffn_core)  # starts while plain and zero run
    try:
        reports = run_engines(model, folder, [EngineRun("plain"), EngineRun("zero", env=zero_env(folder))])
        ffn.wait_ready()
        reports |= run_engines(
            model, folder, [EngineRun("afd", afd=afd_section("attention", port))], core_list=[attention_core]
        )
        reports["ffn"] = ffn.wait()
    finally:
        ffn.kill()
    summary = {name: compare(reports["plain"], reports[name]) for name in ("zero", "afd")}
    print(f"\n[{ARCH}] vs plain: {json.dumps(summary)}\n[{ARCH}] ffn: {json.dumps(reports['ffn'])}", flush=True)
    return reports


def test_qwen2_moe_checkpoint_is_sensitive_to_routed_experts(runs: dict[str, Any]) -> None:
    zero = compare(runs["plain"], runs["zero"])
    assert zero["differing"] >= zero["tokens"] / 2, zero


def test_qwen2_moe_1a1f_afd_is_token_identical_to_plain_vllm(runs: dict[str, Any]) -> None:
    result = compare(runs["plain"], runs["afd"])
    assert result["completions"] == 16, result
    assert_identical(result)


def test_qwen2_moe_attention_holds_no_routed_experts_and_ffn_served_every_moe_call(runs: dict[str, Any]) -> None:
    assert_experts_on_ffn_and_every_call_served(runs)
