"""``afd-mrv2 make-model``: the files vLLM's loader reads, seeded and checked.

Whether vLLM loads and depends on these checkpoints is proven by the
``vllm_runtime`` tests (real engines); here: the files, the shapes the config
implies, determinism and the one-line errors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from afd_mrv2.checkpoints.archs import ARCHS, HEAD_DIM
from afd_mrv2.cli import main


def make(tmp_path: Path, *args: str) -> Path:
    folder = tmp_path / "model"
    assert main(["make-model", str(folder), *args]) == 0
    return folder


def digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_writes_a_loadable_folder_whose_weights_match_its_config(tmp_path: Path, arch: str) -> None:
    folder = make(tmp_path, "--arch", arch, "--layers", "3", "--hidden", "192", "--experts", "6", "--top-k", "3")
    files = {p.name for p in folder.iterdir()}
    assert files == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    h, layers, k = config["hidden_size"], config["num_hidden_layers"], config["num_experts_per_tok"]
    assert (h, layers, k) == (192, 3, 3)
    assert config["num_attention_heads"] * HEAD_DIM == h
    experts = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "deepseek_v2": "n_routed_experts"}[arch]
    assert config[experts] == 6
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], h)
    for layer in range(layers):
        moe = f"model.layers.{layer}." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        assert weights[moe + "gate.weight"].shape == (6, h)
        down = "w2" if arch == "mixtral" else "down_proj"
        assert {n for n in weights if n.startswith(moe + "experts.") and n.endswith(f"{down}.weight")} == {
            f"{moe}experts.{e}.{down}.weight" for e in range(6)
        }
        assert (f"{moe}shared_expert_gate.weight" in weights) == (arch == "qwen2_moe")
    assert all(t.dtype == torch.float32 for t in weights.values())
    norms = [t for n, t in weights.items() if n.endswith("norm.weight")]
    assert norms and all(bool((t == 1).all()) for t in norms)
    drawn = torch.cat([t.flatten() for n, t in weights.items() if not n.endswith("norm.weight")])
    assert 0.07 < float(drawn.std()) < 0.09  # N(0, 0.08): what makes the model depend on its experts
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    text = "the quick brown fox routes tokens to experts"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_same_arguments_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = make(tmp_path / "a", "--arch", "mixtral")
    b = make(tmp_path / "b", "--arch", "mixtral")
    c = make(tmp_path / "c", "--arch", "mixtral", "--seed", "1")
    assert digest(a) == digest(b) != digest(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hidden", "100"], "--hidden: expected a positive multiple of 64 (the head size), got 100"),
        (["--top-k", "9"], "--top-k: expected an integer in 1..8 (--experts), got 9"),
        (["--experts", "1"], "--experts: expected an integer >= 2, got 1"),
        (["--layers", "0"], "--layers: expected an integer >= 1, got 0"),
    ],
)
def test_bad_shapes_fail_with_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    folder = tmp_path / "model"
    assert main(["make-model", str(folder), "--arch", "mixtral", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"afd-mrv2 make-model: error: {message}"
    assert not folder.exists()


def test_refuses_a_non_empty_folder_without_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make(tmp_path, "--arch", "qwen2_moe")
    before = digest(folder)
    assert main(["make-model", str(folder), "--arch", "qwen2_moe", "--seed", "3"]) == 2
    assert "exists and is not empty (pass --overwrite" in capsys.readouterr().err
    assert digest(folder) == before
    assert main(["make-model", str(folder), "--arch", "qwen2_moe", "--seed", "3", "--overwrite"]) == 0
    assert digest(folder) != before
