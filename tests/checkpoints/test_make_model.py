"""``afd-mrv2 make-model``: the files vLLM's loader reads, seeded and checked.

Whether vLLM loads and depends on these checkpoints is proven by the
``vllm_runtime`` tests (real engines); here: the files, the shapes the config
implies, determinism, the one-line errors, the ``--size`` presets (``tiny`` is
byte-for-byte today's checkpoint) and the structure of the bench measurement
(never its timings: the PASS/FAIL it prints is the threshold check).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from afd_mrv2.checkpoints import bench_vllm
from afd_mrv2.checkpoints.archs import ARCHS, HEAD_DIM, PRESETS, ModelShape, shape_for
from afd_mrv2.checkpoints.bench import BALANCE_MAX, HALF_MAX, BenchLoad, LayerCompute, measure_layer_compute
from afd_mrv2.cli import main
from afd_mrv2.errors import ConfigError

EXPERTS_KEY = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "deepseek_v2": "n_routed_experts"}
INTERMEDIATE_KEY = {
    "mixtral": "intermediate_size",
    "qwen2_moe": "moe_intermediate_size",
    "deepseek_v2": "moe_intermediate_size",
}
#: sha256 over (name, raw bytes) of every tensor of ``make-model DIR --arch ARCH`` (the tiny size), in name
#: order: the checkpoint the equivalence tests were written against, unchanged by ``--size``.
TINY_TENSOR_DIGESTS = {
    "mixtral": "3671922dd0ff4f5e",
    "qwen2_moe": "e2b382a2d73dbd61",
    "deepseek_v2": "4f67575fce25b887",
}


def make(tmp_path: Path, *args: str) -> Path:
    folder = tmp_path / "model"
    assert main(["make-model", str(folder), *args]) == 0
    return folder


def digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def tensor_digest(folder: Path) -> str:
    weights = load_file(str(folder / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


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
    assert config[EXPERTS_KEY[arch]] == 6
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


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_shard_partitions_the_same_tensors_with_a_standard_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str
) -> None:
    plain = load_file(str(make(tmp_path / "plain", "--arch", arch) / "model.safetensors"))
    capsys.readouterr()
    folder = make(tmp_path / "sharded", "--arch", arch, "--expert-shard")
    shards = ["model-experts.safetensors", "model-rest.safetensors", "model.safetensors.index.json"]
    assert {p.name for p in folder.iterdir()} == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        *shards,
    }
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith(
            "config.json, generation_config.json, " + ", ".join(shards) + ", tokenizer.json, tokenizer_config.json"
        )
    )
    experts = load_file(str(folder / "model-experts.safetensors"))
    rest = load_file(str(folder / "model-rest.safetensors"))
    assert not set(experts) & set(rest) and set(experts) | set(rest) == set(plain)
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    assert experts and all(re.search(rf"\.{moe}\.experts\.\d+\.", n) for n in experts)
    assert not any(".experts." in n and "shared_expert" not in n for n in rest)
    assert any("shared_expert" in n for n in rest) == (arch != "mixtral")
    assert all(torch.equal(t, plain[n]) for n, t in {**experts, **rest}.items())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        **{n: "model-experts.safetensors" for n in experts},
        **{n: "model-rest.safetensors" for n in rest},
    }
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in plain.values())


def test_overwrite_switches_layout_and_leaves_no_stale_weights(tmp_path: Path) -> None:
    folder = make(tmp_path, "--arch", "qwen2_moe", "--expert-shard")
    assert main(["make-model", str(folder), "--arch", "qwen2_moe", "--overwrite"]) == 0
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]
    assert main(["make-model", str(folder), "--arch", "qwen2_moe", "--overwrite", "--expert-shard"]) == 0
    assert sorted(p.name for p in folder.glob("model*")) == [
        "model-experts.safetensors",
        "model-rest.safetensors",
        "model.safetensors.index.json",
    ]


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


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_is_the_default_and_unchanged(tmp_path: Path, arch: str) -> None:
    default = make(tmp_path / "default", "--arch", arch)
    tiny = make(tmp_path / "tiny", "--arch", arch, "--size", "tiny")
    assert digest(default) == digest(tiny)
    assert tensor_digest(tiny) == TINY_TENSOR_DIGESTS[arch]
    config = json.loads((tiny / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_experts_per_tok"]) == (2, 128, 2)
    assert (config[EXPERTS_KEY[arch]], config[INTERMEDIATE_KEY[arch]]) == (8, 256)


@pytest.mark.parametrize("arch", ARCHS)
def test_bench_writes_the_bench_dimensions(tmp_path: Path, arch: str) -> None:
    folder = make(tmp_path, "--arch", arch, "--size", "bench", "--no-measure")
    bench = PRESETS["bench"]
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == bench.layers
    assert config["hidden_size"] == bench.hidden
    assert config["num_attention_heads"] * HEAD_DIM == bench.hidden
    assert config[EXPERTS_KEY[arch]] == bench.experts
    assert config["num_experts_per_tok"] == bench.top_k
    assert config[INTERMEDIATE_KEY[arch]] == bench.intermediate
    weights = load_file(str(folder / "model.safetensors"))
    moe = "model.layers.0." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
    down = "w2" if arch == "mixtral" else "down_proj"
    assert weights[f"{moe}experts.0.{down}.weight"].shape == (bench.hidden, bench.intermediate)
    if arch == "qwen2_moe":  # its shared expert (on the Attention side in afd-mrv2) has its own size
        assert config["shared_expert_intermediate_size"] == bench.shared_intermediate
        assert weights[f"{moe}shared_expert.down_proj.weight"].shape == (bench.hidden, bench.shared_intermediate)
    drawn = torch.cat([t.flatten() for n, t in weights.items() if not n.endswith("norm.weight")])
    assert 0.9 * bench.std < float(drawn.std()) < 1.1 * bench.std


def test_bench_flags_override_single_dimensions_and_same_arguments_same_bytes(tmp_path: Path) -> None:
    args = ("--arch", "qwen2_moe", "--size", "bench", "--layers", "1", "--experts", "6", "--no-measure")
    a, b = make(tmp_path / "a", *args), make(tmp_path / "b", *args)
    assert digest(a) == digest(b)
    config = json.loads((a / "config.json").read_text())
    bench = PRESETS["bench"]
    assert (config["num_hidden_layers"], config["num_experts"], config["hidden_size"]) == (1, 6, bench.hidden)
    assert shape_for("qwen2_moe", "bench", layers=1, experts=6) == ModelShape(
        "qwen2_moe", 1, bench.hidden, 6, bench.top_k, 0, bench.intermediate, bench.std, bench.shared_intermediate
    )


@pytest.mark.parametrize("size", ["huge", "Bench", ""])
def test_bad_size_fails_with_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str
) -> None:
    folder = tmp_path / "model"
    assert main(["make-model", str(folder), "--arch", "mixtral", "--size", size]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"afd-mrv2 make-model: error: --size: expected one of tiny, bench, got {size!r}"
    assert not folder.exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_measurement_returns_the_four_numbers(arch: str) -> None:
    shape = ModelShape(arch, layers=2, hidden=128, experts=4, top_k=2)
    load = BenchLoad(seqs=8, prompt_min=4, prompt_max=6, decoded=3)
    measured = measure_layer_compute(shape, load, repeats=1, kernels="torch")
    assert isinstance(measured, LayerCompute)
    assert measured.kernels == {"attention": "torch", "ffn": "torch"}
    assert (measured.tokens, measured.half_tokens, measured.layers, measured.repeats) == (8, 4, 2, 1)
    assert 7 <= measured.mean_context <= 9
    for side, name in ((measured.attention, "attention"), (measured.ffn, "ffn")):
        assert side.side == name
        assert side.full_ms > 0 and side.half_ms > 0
        assert side.half_ratio == pytest.approx(side.half_ms / side.full_ms)
        assert side.half_ok == (side.half_ratio <= HALF_MAX)
    assert measured.balance == pytest.approx(measured.attention.half_ms / measured.ffn.half_ms)
    assert measured.balance_ok == (1 / BALANCE_MAX <= measured.balance <= BALANCE_MAX)
    assert measured.ok == (measured.attention.half_ok and measured.ffn.half_ok and measured.balance_ok)
    data = measured.as_dict()
    assert json.loads(json.dumps(data)) == data
    assert {k: data[k] for k in ("tokens", "half_tokens", "threads")} == {"tokens": 8, "half_tokens": 4, "threads": 1}
    for name in ("attention", "ffn"):
        assert set(data[name]) == {"side", "full_ms", "half_ms", "half_ratio", "half_ok"}
    report = measured.report().splitlines()
    assert report[1].split() == ["side", "full", "ms", "half", "ms", "half/full", "<=", str(HALF_MAX)]
    assert report[3].split()[0] == "attention" and report[4].split()[0] == "ffn"
    assert report[3].split()[-1] in ("PASS", "FAIL") and report[4].split()[-1] in ("PASS", "FAIL")
    assert report[5].startswith("a/f = ")


def test_measurement_leaves_the_thread_count_alone() -> None:
    before = torch.get_num_threads()
    measure_layer_compute(ModelShape("mixtral", layers=1, hidden=64, experts=2, top_k=1), BenchLoad(seqs=2), repeats=1)
    assert torch.get_num_threads() == before


def test_measure_flag_prints_the_table_or_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    assert main(["make-model", str(folder), "--arch", "mixtral", "--measure", "--layers", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"afd-mrv2 make-model: wrote {folder} (mixtral, tiny: 1 layers")
    assert lines[1].startswith("per-layer compute on one core (mixtral, decode step of 64 sequences, half = 32")
    assert [line.split()[0] for line in lines[4:6]] == ["attention", "ffn"]
    assert (
        main(["make-model", str(folder), "--arch", "mixtral", "--measure", "--layers", "1", "--overwrite", "--json"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["size"] == "tiny" and summary["arch"] == "mixtral"
    measurement = summary["measurement"]
    assert measurement["tokens"] == 64 and measurement["half_tokens"] == 32
    assert measurement["attention"]["full_ms"] > 0 and measurement["ffn"]["half_ms"] > 0


def test_bad_kernels_fail_with_one_line_and_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    assert main(["make-model", str(folder), "--arch", "mixtral", "--size", "bench", "--kernels", "mkl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "afd-mrv2 make-model: error: --kernels: expected one of auto, torch, vllm, got 'mkl'"
    assert not folder.exists()


def test_auto_kernels_fall_back_to_torch_without_vllm_and_vllm_kernels_are_refused() -> None:
    why = bench_vllm.available()
    if why is None:
        pytest.skip("vLLM's CPU kernels are usable here: auto picks them (see the vllm_kernels test)")
    shape = ModelShape("qwen2_moe", layers=1, hidden=64, experts=2, top_k=1)
    measured = measure_layer_compute(shape, BenchLoad(seqs=4), repeats=1)
    assert measured.kernels == {"attention": "torch", "ffn": "torch"}
    assert measured.kernels_note == why
    assert measured.as_dict()["kernels_note"] == why
    with pytest.raises(ConfigError, match=r"^--kernels: vllm: "):
        measure_layer_compute(shape, BenchLoad(seqs=4), repeats=1, kernels="vllm")
