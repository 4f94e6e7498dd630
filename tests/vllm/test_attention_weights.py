"""RFC 0006 item 3: an Attention engine reads and allocates no routed expert, and loads quantized checkpoints.

Run: ``.venv-vllm/bin/python -m pytest -q -p no:xdist -m vllm_runtime tests/vllm/test_attention_weights.py``.

Each case is one subprocess (tests/vllm/attention_load.py: vLLM builds the model as an engine's worker does,
world of 1 over gloo; a fresh vLLM per case) on the make-model tiny Qwen2-MoE (2 MoE layers, 8 experts) or
a copy of it quantized by afd_mrv2.checkpoints.quantize: ``fp8_block`` (128x128 block scales,
``weight_scale_inv``, DeepSeek-V3's layout) and ``w8a8`` (compressed-tensors int8 on the routed experts).
Building a quantized checkpoint's real method needs its CPU kernel, hence AMX tiles (the ``amx`` cases); the
placeholders' names need no kernel on the ``w8a8`` checkpoint (its attention layers are not quantized) and run
everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from afd_mrv2.checkpoints.quantize import EXPERT_PROJ, quantize_checkpoint
from tests.vllm.harness import make_model

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("attention_load.py")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("attention-weights")
    base = make_model(folder / "bf", "qwen2_moe")
    return {
        "unquantized": base,
        "fp8_block": quantize_checkpoint(base, folder / "fp8", "fp8_block"),
        "w8a8": quantize_checkpoint(base, folder / "w8a8", "w8a8"),
    }


def _run(model: Path, mode: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "VLLM_PLUGINS": ""}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(model), mode, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


#: per checkpoint, the scale suffix of its experts (the afd loader still reads those: upstream's filter keeps
#: scales, RFC 0006 section 1 (b)) and the real quant method vLLM builds for its routed experts
SCALE = {"unquantized": None, "fp8_block": "weight_scale_inv", "w8a8": "weight_scale"}
REAL = {
    "unquantized": "UnquantizedFusedMoEMethod",
    "fp8_block": "Fp8MoEMethod",
    "w8a8": "CompressedTensorsW8A8Int8MoEMethod",
}


@pytest.mark.parametrize(
    "kind",
    ["unquantized", pytest.param("fp8_block", marks=pytest.mark.amx), pytest.param("w8a8", marks=pytest.mark.amx)],
)
def test_attention_layer_has_the_real_methods_parameters_with_0_experts_and_reads_no_expert_weight(
    kind: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    plain = _run(checkpoints[kind], "plain", tmp_path)
    afd = _run(checkpoints[kind], "afd", tmp_path)
    assert plain["quant_method"] == REAL[kind] and plain["local_num_experts"] == [8, 8], plain["quant_method"]
    assert (afd["quant_method"], afd["real_method"]) == ("RemoteExpertsMethod", REAL[kind])
    assert afd["layer_class"] == "AfdRoutedExperts" and afd["registered_loader"] == "AfdModelLoader"
    assert afd["loaded"] is True, afd.get("traceback")
    # every parameter name the real method's create_weights makes, its dtype and trailing shape, 0 elements
    assert afd["params"].keys() == plain["params"].keys() == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}
    for layer, params in plain["params"].items():
        assert afd["params"][layer].keys() == params.keys(), layer
        for name, (shape, dtype, _) in params.items():
            assert afd["params"][layer][name] == [[0, *shape[1:]], dtype, 0], (layer, name)
    if SCALE[kind] is not None:
        assert {f"w13_{SCALE[kind]}", f"w2_{SCALE[kind]}"} <= plain["params"]["model.layers.0.mlp.experts"].keys()
    assert afd["local_num_experts"] == [0, 0] and afd["expert_map"] == [-1] * 8
    assert afd["routed_expert_bytes"] == 0 and plain["routed_expert_bytes"] > 0
    # what the loader materialised: no routed-expert weight; only the experts' scales (kept by upstream's filter)
    assert afd["loader_local_expert_ids"] == [] and afd["expert_weights_yielded"] == []
    assert all(n.endswith(f".{SCALE[kind]}") for n in afd["expert_tensors_yielded"]), afd["expert_tensors_yielded"]
    assert len(afd["expert_tensors_yielded"]) == (0 if SCALE[kind] is None else 48)
    on_disk = list(load_file(str(checkpoints[kind] / "model.safetensors")))
    expert_weights = [n for n in on_disk if EXPERT_PROJ.search(n)]
    assert len(expert_weights) == 48 and afd["tensors_yielded"] == len(on_disk) - 48


#: per checkpoint, the scale parameter its experts' first checkpoint weight misses on the placeholders
MISSING_SCALE = {"fp8_block": "weight_scale_inv", "w8a8": "weight_scale"}


@pytest.mark.parametrize("kind", [pytest.param("fp8_block", marks=pytest.mark.amx), "w8a8"])
def test_a_quantized_checkpoint_fails_with_the_placeholders_the_attention_layer_had(
    kind: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Pinned: the stand-in built without the real method (only w13_weight/w2_weight, as before RFC 0006 item 3,
    and as vLLM-Ascend's layer still gets it) cannot load a checkpoint whose experts carry scales.  ``fp8_block``
    quantizes the attention layers too (their fp8 kernel needs AMX); ``w8a8`` only the experts."""
    report = _run(checkpoints[kind], "placeholders", tmp_path)
    assert report["loaded"] is False
    scale = MISSING_SCALE[kind]
    assert report["error"] == (
        f"AttributeError: Layer model.layers.0.mlp.experts has no parameter 'w2_{scale}' for checkpoint "
        f"weight 'model.layers.0.mlp.experts.0.down_proj.{scale}'"
    )
    assert report["params"]["model.layers.0.mlp.experts"] == {
        "w13_weight": [[0], "torch.bfloat16", 0],
        "w2_weight": [[0], "torch.bfloat16", 0],
    }
