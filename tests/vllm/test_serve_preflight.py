"""``afd-mrv2 serve`` refuses bad setups in its pre-flight: exit 2 within 15 s, one line naming the cause,
no role process started (real vLLM builds each role's config; nothing else starts).

The setups a newcomer hit: an expert count the FFN ranks do not divide, a dense model (both read from the
checkpoint's config.json before vLLM is imported, and again by vLLM in the check's child), an argument that is
not vLLM's, a model folder that does not exist; and a MoE architecture whose config gives it experts but whose
layers are all dense (Qwen2-MoE with ``decoder_sparse_step`` above its layer count): config.json cannot tell, the
child builds the model's layers on the meta device and refuses (without it every role started and the FFN role
failed about a minute later, on the loaded model).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serve.conftest import free_port_block
from tests.vllm.harness import make_model

pytestmark = pytest.mark.vllm_runtime

LIMIT_S = 15.0
#: The first time, an argument vLLM's engine parser does not know is checked with vLLM's OpenAI server parser,
#: which imports the server stack: ~20 s on a 2-core machine (measured 20-26 s), past the 15 s of the others.
#: That run caches vLLM's option names; from the second start on the refusal takes LIMIT_S at most.
PARSER_LIMIT_S = 40.0
#: What only the layers decide is refused by the check's child, after it imported vLLM and built each role's
#: config (measured 17 s on a shared 2-core machine; the meta-device build of the layers is about 1 s of it).
CHILD_LIMIT_S = 40.0


def with_config(source: Path, folder: Path, **changes: object) -> Path:
    """A copy of checkpoint ``source`` whose config.json has ``changes`` (the weights stay: no check reads them)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preflight")
    mixtral = make_model(root / "mixtral", "mixtral")  # 8 routed experts
    dense = root / "dense"  # the same checkpoint described as a dense Mistral: no routed-experts layer
    shutil.copytree(mixtral, dense)
    config = json.loads((dense / "config.json").read_text())
    for key in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"):
        config.pop(key, None)
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (dense / "config.json").write_text(json.dumps(config))
    qwen = make_model(root / "qwen2-moe", "qwen2_moe")  # 2 layers, 8 routed experts
    dense_layers = with_config(qwen, root / "qwen2-moe-dense-layers", decoder_sparse_step=4)  # no layer is MoE
    return {"mixtral": mixtral, "dense": dense, "missing": root / "no-such-model", "dense-layers": dense_layers}


CASES = {  # model, serve arguments, arguments after --, what the one line must say
    "ffn-9-for-8-experts": (  # 8 experts on 3 FFN ranks is placed now (3, 3, 2); 9 ranks leave one empty
        "mixtral",
        ["--ffn", "9"],
        [],
        "afd.num_ffn_ranks: num_experts (8) must be at least the FFN ranks (9): every FFN rank holds an expert",
    ),
    "dense-model": ("dense", ["--ffn", "1"], [], "afd: the model (MistralForCausalLM) has no routed-experts layer"),
    "not-a-vllm-argument": (
        "mixtral",
        ["--ffn", "1"],
        ["--no-such-flag"],
        "not vLLM engine or server arguments: --no-such-flag",
    ),
    "missing-model-folder": ("missing", ["--ffn", "1"], [], "model folder {model} does not exist"),
    "moe-config-dense-layers": (
        "dense-layers",
        ["--ffn", "2"],  # 8 experts over 2 FFN ranks: config.json passes
        [],
        "afd: the model (Qwen2MoeForCausalLM) has no routed-experts layer: its config gives 8 routed experts, "
        "but none of the 2 layers vLLM builds of it is a MoE layer",
    ),
}


def refused(case: str, model: Path, cache: Path) -> float:
    """Run serve on a bad setup with its own option cache folder; check the refusal; return its seconds."""
    _, args, vllm_args, expected = CASES[case]
    exe = Path(sys.executable).with_name("afd-mrv2")
    cmd = [str(exe), "serve", str(model), "--attention", "1", *args, "--port", str(free_port_block(4))]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    start = time.monotonic()
    proc = subprocess.run(
        [*cmd, "--", "--dtype", "float32", *vllm_args], capture_output=True, text=True, timeout=120, env=env
    )
    took = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    print(f"\n[preflight] {case}: exit {proc.returncode} in {took:.1f} s: {lines}", flush=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(lines) == 1, lines
    assert lines[0].startswith("afd-mrv2 serve: error: ") and expected.format(model=model) in lines[0], lines
    assert "started pid" not in proc.stderr  # no role process was started
    return took


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_setup_exits_2_in_one_line_before_any_role_starts(
    models: dict[str, Path], case: str, tmp_path: Path
) -> None:
    took = refused(case, models[CASES[case][0]], tmp_path / "cache")  # a cold cache: what a first start does
    limit = {"not-a-vllm-argument": PARSER_LIMIT_S, "moe-config-dense-layers": CHILD_LIMIT_S}.get(case, LIMIT_S)
    assert took < limit, f"{case}: refused after {took:.1f} s"


def test_an_unknown_vllm_argument_is_refused_within_15_s_once_vllms_options_are_cached(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The first pre-flight with this vLLM caches its option names (any start does, good or bad); the next
    refuses an unknown one from them, without importing vLLM."""
    cache = tmp_path / "cache"
    refused("not-a-vllm-argument", models["mixtral"], cache)
    (written,) = (cache / "afd-mrv2").glob("vllm*-serve-options.json")
    assert "--max-model-len" in json.loads(written.read_text())
    took = refused("not-a-vllm-argument", models["mixtral"], cache)
    assert took < LIMIT_S, f"refused after {took:.1f} s with vLLM's options cached"


def test_the_child_counts_the_moe_layers_vllm_builds_without_reading_a_weight(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """serve's pre-flight child on the layers themselves: ``mlp_only_layers`` covering every layer refuses as
    ``decoder_sparse_step`` does, one MoE layer of two passes (and says so), and the weights are never read (the
    checkpoint's safetensors file is replaced by garbage)."""
    qwen = models["dense-layers"].with_name("qwen2-moe")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    answers = {}
    for name, mlp_only in (("all-dense", [0, 1]), ("one-moe", [0])):
        model = with_config(qwen, tmp_path / name, mlp_only_layers=mlp_only)
        (model / "model.safetensors").write_bytes(b"not a safetensors file")
        out = tmp_path / f"{name}.json"
        section = {"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 2}
        cmd = [sys.executable, "-m", "afd_mrv2.serve.preflight", str(model), "--out", str(out)]
        cmd += ["--section", json.dumps(section), "--", "--dtype", "float32", "--max-model-len", "256"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        answers[name] = (proc.returncode, json.loads(out.read_text()))
        print(f"\n[preflight] child, mlp_only_layers={mlp_only}: {answers[name]}", flush=True)
    code, refused = answers["all-dense"]
    assert code == 2 and refused["refused"].startswith("afd: the model (Qwen2MoeForCausalLM) has no routed-experts")
    assert refused["model"] == {
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_experts": 8,
        "moe_layers": 0,
        "layers": 2,
    }
    code, passed = answers["one-moe"]
    assert code == 0 and passed["model"]["moe_layers"] == 1, passed
