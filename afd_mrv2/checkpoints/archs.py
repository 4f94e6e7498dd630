"""The supported architectures: their ``config.json`` and the names and shapes of their weights.

Each architecture is a vLLM MoE model whose routed experts go through vLLM's
``RoutedExperts`` layer: Mixtral (no shared expert, renormalized top-k),
DeepSeek-V2 (MLA attention, one ungated shared expert, raw top-k) and Qwen2-MoE
(attention biases, a gated shared expert, raw top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_mrv2.errors import ConfigError

ARCHS = ("mixtral", "deepseek_v2", "qwen2_moe")
SIZES = ("tiny", "bench")
HEAD_DIM = 64  # vLLM's CPU attention backend refuses small head sizes (16 is refused)
VOCAB = 512
#: vLLM's CPU MLA decode kernel compiles only for a latent size kv_lora_rank + qk_rope_head_dim of 576.
MLA_KV_LORA_RANK, MLA_ROPE_DIM, MLA_NOPE_DIM, MLA_V_DIM = 512, 64, 64, 64


#: Standard deviation of every drawn weight of the tiny size (norms are ones): large enough for
#: the model to depend on its routed-expert output (see the package docstring).
STD = 0.08


@dataclass(frozen=True)
class ModelShape:
    """What ``make-model`` was asked for; checked by :meth:`check`.  ``intermediate_size`` None means
    twice the hidden size (the tiny size's rule); ``shared_intermediate_size`` (Qwen2-MoE's shared
    expert) None means the experts' size; ``std`` is the standard deviation of the drawn weights."""

    arch: str
    layers: int = 2
    hidden: int = 128
    experts: int = 8
    top_k: int = 2
    seed: int = 0
    intermediate_size: int | None = None
    std: float = STD
    shared_intermediate_size: int | None = None

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM

    @property
    def intermediate(self) -> int:
        """Each routed expert's (and DeepSeek-V2's shared expert's) intermediate size."""
        return self.intermediate_size if self.intermediate_size is not None else 2 * self.hidden

    @property
    def shared_intermediate(self) -> int:
        """Qwen2-MoE's shared expert's intermediate size."""
        return self.shared_intermediate_size if self.shared_intermediate_size is not None else self.intermediate

    def check(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError("--arch", f"expected one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.layers < 1:
            raise ConfigError("--layers", f"expected an integer >= 1, got {self.layers}")
        if self.hidden < HEAD_DIM or self.hidden % HEAD_DIM:
            raise ConfigError(
                "--hidden", f"expected a positive multiple of {HEAD_DIM} (the head size), got {self.hidden}"
            )
        if self.experts < 2:
            raise ConfigError("--experts", f"expected an integer >= 2, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError("--top-k", f"expected an integer in 1..{self.experts} (--experts), got {self.top_k}")
        if self.intermediate < 1:
            raise ConfigError("--intermediate", f"expected an integer >= 1, got {self.intermediate}")
        if self.shared_intermediate < 1:
            raise ConfigError("shared_intermediate_size", f"expected an integer >= 1, got {self.shared_intermediate}")


@dataclass(frozen=True)
class Size:
    """A ``--size`` preset: the dimensions ``make-model`` uses where no flag overrides them."""

    layers: int
    hidden: int
    experts: int
    top_k: int
    intermediate: int | None  # None: twice the hidden size
    std: float
    #: Qwen2-MoE's shared expert (None: the experts' size); it runs on the Attention side in afd-mrv2
    shared_intermediate: int | None = None


#: ``tiny``: the checkpoint the equivalence tests use (fast to load and run, not worth overlapping).
#: ``bench``: sized for the micro-batching benchmark (docs/benchmarks-vllm.md, "The bench
#: checkpoint"): at a 64-sequence decode step half a batch costs about 0.6 of a whole one on both
#: sides at the kernel level, and the two sides' half-batch costs are within 1.5x
#: (:mod:`afd_mrv2.checkpoints.bench` measures it; the docs also have real vLLM's numbers).
PRESETS: dict[str, Size] = {
    "tiny": Size(layers=2, hidden=128, experts=8, top_k=2, intermediate=None, std=STD),
    "bench": Size(layers=4, hidden=512, experts=4, top_k=2, intermediate=1024, std=STD, shared_intermediate=512),
}


def shape_for(
    arch: str,
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    intermediate: int | None = None,
    seed: int = 0,
) -> ModelShape:
    """The shape of ``size`` for ``arch``, with every dimension given (not None) overriding the preset's."""
    if size not in PRESETS:
        raise ConfigError("--size", f"expected one of {', '.join(SIZES)}, got {size!r}")
    p = PRESETS[size]
    return ModelShape(
        arch,
        layers=p.layers if layers is None else layers,
        hidden=p.hidden if hidden is None else hidden,
        experts=p.experts if experts is None else experts,
        top_k=p.top_k if top_k is None else top_k,
        seed=seed,
        intermediate_size=p.intermediate if intermediate is None else intermediate,
        std=p.std,
        shared_intermediate_size=p.shared_intermediate,
    )


def _common_config(shape: ModelShape) -> dict[str, object]:
    """The ``config.json`` keys every architecture here shares."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "intermediate_size": shape.intermediate,
        "num_experts_per_tok": shape.top_k,
    }


def config_json(shape: ModelShape) -> dict[str, object]:
    """The Hugging Face ``config.json`` of ``shape``."""
    common = _common_config(shape)
    if shape.arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "head_dim": HEAD_DIM,
            "num_local_experts": shape.experts,
            "sliding_window": None,
            **common,
        }
    if shape.arch == "qwen2_moe":
        return {
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "moe_intermediate_size": shape.intermediate,
            "shared_expert_intermediate_size": shape.shared_intermediate,
            "num_experts": shape.experts,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
            **common,
        }
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "moe_intermediate_size": shape.intermediate,
        "n_routed_experts": shape.experts,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "q_lora_rank": None,
        "kv_lora_rank": MLA_KV_LORA_RANK,
        "qk_nope_head_dim": MLA_NOPE_DIM,
        "qk_rope_head_dim": MLA_ROPE_DIM,
        "v_head_dim": MLA_V_DIM,
        "rope_scaling": None,
        "attention_bias": False,
        **common,
    }


def weight_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by name, in the order it is drawn.  Norm weights are listed too
    (they are written as ones, see :func:`is_norm`)."""
    h, inter, e = shape.hidden, shape.intermediate, shape.experts
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, h), "lm_head.weight": (VOCAB, h)}
    out["model.norm.weight"] = (h,)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out.update(_attention(shape, p + "self_attn."))
        moe = p + ("block_sparse_moe." if shape.arch == "mixtral" else "mlp.")
        out[moe + "gate.weight"] = (e, h)
        names = ("w1", "w3", "w2") if shape.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for x in range(e):
            out.update(_mlp(f"{moe}experts.{x}.", names, h, inter))
        if shape.arch == "qwen2_moe":
            out.update(_mlp(moe + "shared_expert.", names, h, shape.shared_intermediate))
        elif shape.arch == "deepseek_v2":
            out.update(_mlp(moe + "shared_experts.", names, h, inter))
        if shape.arch == "qwen2_moe":
            out[moe + "shared_expert_gate.weight"] = (1, h)
    return out


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _mlp(prefix: str, names: tuple[str, str, str], hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    return {
        f"{prefix}{gate}.weight": (inter, hidden),
        f"{prefix}{up}.weight": (inter, hidden),
        f"{prefix}{down}.weight": (hidden, inter),
    }


def _attention(shape: ModelShape, p: str) -> dict[str, tuple[int, ...]]:
    h, heads = shape.hidden, shape.heads
    if shape.arch == "deepseek_v2":
        return {
            p + "q_proj.weight": (heads * (MLA_NOPE_DIM + MLA_ROPE_DIM), h),
            p + "kv_a_proj_with_mqa.weight": (MLA_KV_LORA_RANK + MLA_ROPE_DIM, h),
            p + "kv_a_layernorm.weight": (MLA_KV_LORA_RANK,),
            p + "kv_b_proj.weight": (heads * (MLA_NOPE_DIM + MLA_V_DIM), MLA_KV_LORA_RANK),
            p + "o_proj.weight": (h, heads * MLA_V_DIM),
        }
    width = heads * HEAD_DIM
    out: dict[str, tuple[int, ...]] = {
        p + "q_proj.weight": (width, h),
        p + "k_proj.weight": (width, h),
        p + "v_proj.weight": (width, h),
        p + "o_proj.weight": (h, width),
    }
    if shape.arch == "qwen2_moe":  # Qwen2 attention has q/k/v biases
        out.update({p + "q_proj.bias": (width,), p + "k_proj.bias": (width,), p + "v_proj.bias": (width,)})
    return out
