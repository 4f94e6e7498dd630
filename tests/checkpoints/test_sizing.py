"""``afd_mrv2.checkpoints.sizing``: each kind's and each role's weight bytes, reading no weights.

On the real config.json of DeepSeek-V3, Qwen3-235B-A22B and Kimi-K2-Instruct (tests/data/configs): the
routed-expert bytes each FFN rank holds and reads by the closed formula, and the parameter count against
the published totals; on checkpoints written here: the safetensors-header count against the real tensors'
bytes, the config.json count against the header count (fp8 with block scales and an MTP layer too), and
each role's bytes read against the header tensors vLLM's expert filter lets through.
"""

from __future__ import annotations

import json
import re
from math import ceil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from afd_mrv2.checkpoints.archs import ARCHS, shape_for
from afd_mrv2.checkpoints.make import make_checkpoint
from afd_mrv2.checkpoints.sizing import KINDS, kind_of, plan_roles, read_header, size_checkpoint
from afd_mrv2.checkpoints.sizing_config import kinds_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"

#: (MoE layers, routed experts, hidden, expert intermediate, bytes per weight, fp8 block) from the model cards
#: and configs: DeepSeek-V3 61 layers of which the first 3 dense; Kimi-K2 61 of which 1 dense; Qwen3 all 94 MoE.
EXPERTS = {
    "DeepSeek-V3": (58, 256, 7168, 2048, 1, 128),
    "Qwen3-235B-A22B": (94, 128, 4096, 1536, 2, None),
    "Kimi-K2-Instruct": (60, 384, 7168, 2048, 1, 128),
}
#: Published totals: DeepSeek-V3's 671B main model (its README: 685B on the Hub = 671B + 14B of the MTP module,
#: which plan leaves out); Qwen3-235B-A22B's model card, 235B; Kimi-K2-Instruct's safetensors parameter count on
#: the Hub, 1026.5B (its card rounds it to 1T; its technical report says 1.04T).
CARD_PARAMETERS = {"DeepSeek-V3": 671e9, "Qwen3-235B-A22B": 235e9, "Kimi-K2-Instruct": 1026.5e9}


def expert_scales(hidden: int, inter: int, block: int | None) -> int:
    """One routed expert's float32 block scales in one layer (gate, up and down; none unquantized)."""
    return 0 if block is None else 3 * ceil(hidden / block) * ceil(inter / block) * 4


def expert_bytes(hidden: int, inter: int, width: int, block: int | None) -> int:
    """One routed expert in one layer: gate, up and down, plus float32 scales per block when fp8."""
    return 3 * hidden * inter * width + expert_scales(hidden, inter, block)


@pytest.mark.parametrize("model", sorted(EXPERTS))
@pytest.mark.parametrize(("ffn", "replicas"), [(1, 1), (4, 1), (8, 2), (32, 3)])
def test_each_ffn_rank_holds_the_formulas_routed_expert_bytes(model: str, ffn: int, replicas: int) -> None:
    layers, experts, hidden, inter, width, block = EXPERTS[model]
    sizes = size_checkpoint(CONFIGS / model)
    assert (sizes.source, sizes.moe_layers, sizes.num_experts) == ("config.json", layers, experts)
    assert sizes.kinds["routed_experts"] == layers * experts * expert_bytes(hidden, inter, width, block)
    scales = layers * expert_scales(hidden, inter, block)  # one expert's, over the MoE layers
    assert sizes.expert_scale_bytes == (scales,) * experts
    plans = plan_roles(sizes, 2, ffn, replicas)
    attention, ffns = plans[0], plans[1:]
    rest = sizes.total - sizes.kinds["routed_experts"]
    assert (attention.role, attention.ranks, attention.routed_bytes) == ("attention", (0, 1), 0)
    assert (attention.weights, attention.reads) == (rest, rest + experts * scales)
    assert [r for p in ffns for r in p.ranks] == list(range(ffn))
    held = experts * replicas // ffn
    for p in ffns:
        weights = layers * experts * 3 * hidden * inter * width * replicas // ffn  # MoE layers x E x 3hI x dtype x R/F
        assert (p.role, p.experts, p.routed_bytes, p.weights) == ("ffn", held, weights + held * scales, p.routed_bytes)
        assert p.reads == rest + p.weights + (experts - held) * scales  # all else, read and dropped


@pytest.mark.parametrize("model", sorted(CARD_PARAMETERS))
def test_the_roles_add_up_to_the_published_parameter_count(model: str) -> None:
    params = size_checkpoint(CONFIGS / model, parameters=True)
    plans = plan_roles(params, 1, 8, 1)
    held = plans[0].weights + sum(p.weights * len(p.ranks) for p in plans[1:])
    assert held == params.total
    assert abs(params.total - CARD_PARAMETERS[model]) / CARD_PARAMETERS[model] < 0.01


@pytest.mark.parametrize("arch", ARCHS)
def test_the_header_count_is_the_tensors_bytes_and_the_config_count(tmp_path: Path, arch: str) -> None:
    folder = tmp_path / arch
    make_checkpoint(folder, shape_for(arch, layers=3, experts=6, hidden=128))
    weights = load_file(str(folder / "model.safetensors"))
    sizes = size_checkpoint(folder)
    assert sizes.source == "safetensors headers (1 file)"
    assert sizes.total == sum(t.numel() * t.element_size() for t in weights.values())
    assert sizes.kinds["routed_experts"] == sum(
        t.numel() * t.element_size() for n, t in weights.items() if ".experts." in n
    )
    assert sizes.expert_bytes == (sizes.kinds["routed_experts"] // 6,) * 6
    assert sizes.expert_scale_bytes == (0,) * 6
    config = json.loads((folder / "config.json").read_text())
    kinds, one_expert = kinds_from_config(config)
    assert kinds == dict(sizes.kinds)
    assert one_expert * 3 == sizes.expert_bytes[0]
    assert size_checkpoint(folder, parameters=True).total == sum(t.numel() for t in weights.values())


def _deepseek_v3_fp8(folder: Path) -> dict[str, tuple[int, ...]]:
    """A two-layer DeepSeek-V3-style fp8 checkpoint (layer 0 dense, layer 1 MoE, layer 2 the MTP layer)."""
    h, e, inter, dense, vocab = 256, 4, 128, 320, 64
    config = {
        "model_type": "deepseek_v3", "torch_dtype": "bfloat16", "hidden_size": h, "num_hidden_layers": 2,
        "first_k_dense_replace": 1, "n_routed_experts": e, "n_shared_experts": 1, "moe_intermediate_size": inter,
        "intermediate_size": dense, "vocab_size": vocab, "num_attention_heads": 2, "q_lora_rank": 96,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "topk_method": "noaux_tc", "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }  # fmt: skip
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    linears: dict[str, tuple[int, int]] = {}
    plain: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h)}
    plain["model.norm.weight"] = (h,)
    for layer in range(3):
        p = f"model.layers.{layer}."
        plain.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        plain.update({p + "self_attn.q_a_layernorm.weight": (96,), p + "self_attn.kv_a_layernorm.weight": (64,)})
        a = p + "self_attn."
        linears.update({a + "q_a_proj.weight": (96, h), a + "q_b_proj.weight": (2 * 48, 96)})
        linears.update({a + "kv_a_proj_with_mqa.weight": (80, h), a + "kv_b_proj.weight": (2 * 64, 64)})
        linears[a + "o_proj.weight"] = (h, 2 * 32)
        mlps = [(p + "mlp.", dense)] if layer == 0 else [(p + "mlp.shared_experts.", inter)]
        mlps += [(f"{p}mlp.experts.{x}.", inter) for x in range(e)] if layer else []
        for prefix, width in mlps:
            linears.update({prefix + "gate_proj.weight": (width, h), prefix + "up_proj.weight": (width, h)})
            linears[prefix + "down_proj.weight"] = (h, width)
        if layer:
            plain[p + "mlp.gate.weight"] = (e, h)
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in plain.items()}
    for name, (rows, cols) in linears.items():
        tensors[name] = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(ceil(rows / 128), ceil(cols / 128), dtype=torch.float32)
    for layer in (1, 2):
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = torch.zeros(e, dtype=torch.float32)
    half = dict(sorted(tensors.items())[: len(tensors) // 2])  # two files, as a sharded checkpoint
    save_file(half, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: t for n, t in tensors.items() if n not in half}, str(folder / "model-00002-of-00002.safetensors"))
    return {n: tuple(t.shape) for n, t in tensors.items()}


def test_fp8_block_scales_and_the_mtp_layer_from_headers_and_from_the_config(tmp_path: Path) -> None:
    folder = tmp_path / "dsv3"
    shapes = _deepseek_v3_fp8(folder)
    sizes = size_checkpoint(folder)
    assert sizes.source == "safetensors headers (2 files)"
    files = sorted(folder.glob("*.safetensors"))
    on_disk = {n: i for f in files for n, i in read_header(f).items() if n != "__metadata__"}
    assert set(on_disk) == set(shapes)
    mtp = sum(i["data_offsets"][1] - i["data_offsets"][0] for n, i in on_disk.items() if ".layers.2." in n)
    assert sizes.mtp == mtp > 0 and sizes.mtp_layers == 1
    assert sizes.total + sizes.mtp == sum(f.stat().st_size - 8 - (read_len(f)) for f in files)
    config = json.loads((folder / "config.json").read_text())
    kinds, _ = kinds_from_config(config)
    assert kinds == dict(sizes.kinds)  # the config.json formulas count what the checkpoint has, scales included
    assert size_checkpoint(folder / "config.json").kinds == sizes.kinds  # config alone: same counts
    params = size_checkpoint(folder, parameters=True)
    assert params.kinds == kinds_from_config(config, parameters=True)[0]
    scales = {n: i for n, i in on_disk.items() if ".layers.1.mlp.experts." in n and n.endswith("_scale_inv")}
    assert sum(sizes.expert_scale_bytes) == sum(i["data_offsets"][1] - i["data_offsets"][0] for i in scales.values())
    assert size_checkpoint(folder / "config.json").expert_scale_bytes == sizes.expert_scale_bytes


def test_each_role_reads_what_vllms_expert_filter_lets_through(tmp_path: Path) -> None:
    """Bytes read at start: every header tensor of the main layers but the routed-expert weights (not their
    scales) of the experts the role does not hold; an FFN rank holds its routed experts alone."""
    folder = tmp_path / "dsv3"
    _deepseek_v3_fp8(folder)
    sizes = size_checkpoint(folder)
    files = sorted(folder.glob("*.safetensors"))
    on_disk = {n: i for f in files for n, i in read_header(f).items() if n != "__metadata__"}

    def nbytes(held: set[int] | None, *, scales: bool) -> int:
        """The main layers' tensors but the routed experts outside ``held`` (all held: None), their scales
        kept when ``scales``."""

        def keep(name: str) -> bool:
            match = re.search(r"\.experts\.(\d+)\.", name)
            return not match or held is None or int(match.group(1)) in held or (scales and name.endswith("_inv"))

        return sum(
            i["data_offsets"][1] - i["data_offsets"][0] for n, i in on_disk.items() if keep(n) and ".layers.2." not in n
        )

    def experts_only(held: set[int]) -> int:
        return nbytes(held, scales=False) - nbytes(set(), scales=False)

    attention, *ffns = plan_roles(sizes, 1, 3, 1)  # 4 experts on 3 ranks: {0, 1}, {2}, {3}
    assert (attention.weights, attention.reads) == (nbytes(set(), scales=False), nbytes(set(), scales=True))
    assert [(p.ranks, p.experts) for p in ffns] == [((0,), 2), ((1, 2), 1)]
    for plan, held in zip(ffns, ({0, 1}, {2}), strict=True):
        assert (plan.weights, plan.reads) == (experts_only(held), nbytes(held, scales=True))
    assert nbytes(None, scales=False) == sizes.total


def read_len(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("model.layers.4.mlp.experts.17.down_proj.weight_scale_inv", "routed_experts"),
        ("model.layers.0.block_sparse_moe.experts.3.w1.weight", "routed_experts"),
        ("model.layers.4.mlp.gate.e_score_correction_bias", "router"),
        ("model.layers.4.block_sparse_moe.gate.weight", "router"),
        ("model.layers.4.mlp.shared_expert_gate.weight", "shared_experts"),
        ("model.layers.4.mlp.shared_experts.up_proj.weight", "shared_experts"),
        ("model.layers.4.self_attn.kv_a_layernorm.weight", "attention"),
        ("model.layers.0.mlp.gate_proj.weight", "dense_mlp"),
        ("model.layers.0.input_layernorm.weight", "norms"),
        ("model.embed_tokens.weight", "embeddings"),
        ("lm_head.weight", "lm_head"),
        ("model.rotary_emb.inv_freq", "other"),
    ],
)
def test_tensor_names_are_classified_by_kind(name: str, kind: str) -> None:
    assert kind in KINDS
    assert kind_of(name) == kind
