"""Admission: the one ordered list of named checks an ``afd`` section passes before anything AFD exists.

Each :class:`Check` names what it reads and refuses in one line naming the key; :func:`run` runs
:data:`CHECKS` in order, filtered by the :class:`Stage` facts a caller holds (serve's pre-flight,
each vLLM process's ``admit``).  The list, and who runs which stage: docs/vllm.md, "Admission".
:func:`afd_section` reads the section where afd-mrv2's own keys live (``additional_config``, or
``$AFD_MRV2_ADDITIONAL_CONFIG`` on vLLM-Ascend: docs/config.md, "Where the afd section goes").
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, final

from afd_mrv2 import envs
from afd_mrv2.compat import CompatRefused, Decision, check_runtime, detect_runtime, vllm_path_capabilities
from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.items import ATTENTION
from afd_mrv2.plugins import check_plugins, entry_points
from afd_mrv2.support_matrix import RULES, Deployment, Rule, known_fact

#: The compat decision for a tuple of required capabilities (``check_runtime`` by default; tests pass their own).
Gate = Callable[[tuple[str, ...]], Decision]


class Stage(enum.IntEnum):
    """What a caller knows when it admits a section, in the order it comes to know it."""

    #: the ``afd`` section and the installed ``afd_mrv2`` plugins
    CONFIG = 1
    #: + the installed runtime versions (torch, vLLM, vLLM-Ascend: the compat decision)
    RUNTIME = 2
    #: + the engine's ``VllmConfig``, read into a :class:`~afd_mrv2.support_matrix.Deployment`
    VLLM_CONFIG = 3
    #: + the model: the MoE layers it builds, or short of them its config's routed-expert count
    MODEL = 4


@final
@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the ``MODEL`` checks read of the model."""

    #: its architectures (``config.json``), for the message
    architectures: tuple[str, ...]
    #: routed experts per MoE layer: as its layers hold them where they were built, else as its config says (0: none)
    num_experts: int
    #: the routed-experts (MoE) layers the model builds; None where only its config was read
    moe_layers: int | None = None
    #: its decoder layers, where ``moe_layers`` is known
    layers: int | None = None


@final
class Subject:
    """What is known of one role when its checks run: the section, and the facts of each later stage.

    ``deployment`` and ``model`` may be functions, called on first use (a check that refuses earlier
    spares the reading); ``gate`` None is :func:`afd_mrv2.compat.check_runtime`.
    """

    __slots__ = ("_config", "_deployment", "_model", "gate", "section", "v2_runner")

    def __init__(
        self,
        section: object,
        *,
        v2_runner: bool = False,
        gate: Gate | None = None,
        deployment: Deployment | Callable[[], Deployment] | None = None,
        model: ModelFacts | Callable[[], ModelFacts | None] | None = None,
    ) -> None:
        #: the raw ``afd`` section, or its parsed :class:`AfdConfig`
        self.section = section
        #: whether the engine runs vLLM's Model Runner V2 (then the runtime pair must grant ``mrv2``)
        self.v2_runner = v2_runner
        self.gate = gate
        self._config = section if isinstance(section, AfdConfig) else None
        self._deployment = functools.cache(deployment if callable(deployment) else lambda: deployment)
        self._model = functools.cache(model if callable(model) else lambda: model)

    @property
    def config(self) -> AfdConfig:
        """The parsed section (parsed once; a bad one raises :class:`ConfigError` naming the key)."""
        if self._config is None:
            self._config = parse_afd_config(self.section)
        return self._config

    @property
    def deployment(self) -> Deployment:
        deployment = self._deployment()
        if deployment is None:
            raise TypeError("the VLLM_CONFIG checks need the engine's Deployment (Subject(deployment=...))")
        return deployment

    @property
    def model(self) -> ModelFacts | None:
        """The model's facts, or None where nothing decides them (its config names no expert count vLLM reads)."""
        return self._model()


@final
@dataclass(frozen=True, slots=True)
class Check:
    """One named admission check."""

    name: str
    #: the least a caller must know to run it
    stage: Stage
    #: what it reads
    reads: str
    #: raises one line naming the key (ConfigError, PluginError or CompatRefused); returns None otherwise
    run: Callable[[Subject], None]


# ------------------------------------------------------------------ afd-mrv2's own keys, and their two channels

#: The ``afd`` section's key.
AFD_KEY = "afd"
#: The FFN role process's pid, which its serving worker ends with (set by ``afd_mrv2.mrv2.ffn.role``).
LEADER_KEY = "afd_mrv2_ffn_leader_pid"
#: afd-mrv2's own ``additional_config`` keys: the only keys ``$AFD_MRV2_ADDITIONAL_CONFIG`` may hold.
OWN_KEYS = (AFD_KEY, LEADER_KEY)
#: Platforms (:attr:`afd_mrv2.compat.detect.Runtime.platform`) whose ``additional_config`` refuses keys it does
#: not own: vllm-ascend's ``init_ascend_config`` builds ``AscendConfig(**additional_config)`` with pydantic
#: ``extra="forbid"`` when the ``VllmConfig`` is built and in ``NPUWorker.__init__``.  There afd-mrv2's keys
#: travel in ``$AFD_MRV2_ADDITIONAL_CONFIG`` (:func:`place_own_keys`).
PLATFORMS_WITH_STRICT_ADDITIONAL_CONFIG = frozenset({"ascend"})


def _env_keys(env: envs.Env | None) -> dict[str, Any]:
    name = envs.ADDITIONAL_CONFIG.name
    text = envs.additional_config(env)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(name, f"expected a JSON object, got malformed JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(name, f"expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(OWN_KEYS))
    if unknown:
        raise ConfigError(
            name,
            f"holds afd-mrv2's own keys only ({', '.join(OWN_KEYS)}), got {', '.join(map(repr, unknown))}; "
            "other keys go to vLLM's additional_config",
        )
    return value


def own_keys(additional_config: object, env: envs.Env | None = None) -> dict[str, Any]:
    """afd-mrv2's own keys (:data:`OWN_KEYS`) of an engine: those of its ``additional_config`` and of
    ``$AFD_MRV2_ADDITIONAL_CONFIG`` (``env``: ``os.environ`` by default), together.

    A key in both with different values, malformed JSON or a key that is not afd-mrv2's in the variable
    raise :class:`ConfigError` naming the places.
    """
    config = additional_config if isinstance(additional_config, Mapping) else {}
    found = {key: config[key] for key in OWN_KEYS if key in config}
    from_env = _env_keys(env)
    for key in sorted(found.keys() & from_env.keys()):
        if found[key] != from_env[key]:
            raise ConfigError(
                key,
                f"additional_config[{key!r}] and ${envs.ADDITIONAL_CONFIG.name} set different values "
                f"({json.dumps(found[key], default=repr)} vs {json.dumps(from_env[key], default=repr)}); "
                "set it in one place",
            )
    return {**found, **from_env}


def afd_section(additional_config: object, env: envs.Env | None = None) -> object | None:
    """The raw ``afd`` section of an engine (:func:`own_keys`: its ``additional_config`` or
    ``$AFD_MRV2_ADDITIONAL_CONFIG``), or None when there is none."""
    return own_keys(additional_config, env).get(AFD_KEY)


def own_keys_in_env(platform: str | None = None) -> bool:
    """Whether afd-mrv2's own keys travel in ``$AFD_MRV2_ADDITIONAL_CONFIG`` on ``platform`` (None: the
    detected one): on :data:`PLATFORMS_WITH_STRICT_ADDITIONAL_CONFIG`."""
    return (detect_runtime().platform if platform is None else platform) in PLATFORMS_WITH_STRICT_ADDITIONAL_CONFIG


def place_own_keys(
    additional_config: Mapping[str, Any], own: Mapping[str, Any], *, in_env: bool | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``additional_config`` and the environment to give an engine that must read afd-mrv2's ``own`` keys.

    ``in_env`` None: :func:`own_keys_in_env` on the detected platform.  False: ``{**additional_config, **own}``
    and no environment (as on CPU and CUDA).  True (vLLM-Ascend): ``additional_config`` less :data:`OWN_KEYS`
    (the user's keys stay) and ``$AFD_MRV2_ADDITIONAL_CONFIG`` holding ``own`` as JSON.
    """
    if not (own_keys_in_env() if in_env is None else in_env):
        return {**additional_config, **own}, {}
    users = {key: value for key, value in additional_config.items() if key not in OWN_KEYS}
    return users, {envs.ADDITIONAL_CONFIG.name: json.dumps(dict(own), sort_keys=True)}


# ------------------------------------------------------------------ the connector's declarations


def _connector_factory(name: str) -> object | None:
    """The installed connector ``name``'s factory (loading the entry point imports its module, nothing more:
    no connector object is built), or None when it is not installed."""
    point = entry_points().get(name)
    if point is None:
        return None
    try:
        factory: object = point.load()
    except Exception as exc:
        raise PluginError(f"connector {name!r} failed to load from {point.value!r}: {exc}") from exc
    return factory


def connector_capability(name: str) -> str | None:
    """The runtime-pair capability the installed connector ``name`` declares, if any.

    A connector factory declares it as the class attribute ``required_capability``
    (a capability name of :mod:`afd_mrv2.compat`, or None); built-in and
    third-party connectors alike.
    """
    factory = _connector_factory(name)
    capability = getattr(factory, "required_capability", None)  # optional: most connectors need none
    if capability is not None and not isinstance(capability, str):
        raise PluginError(f"connector {name!r}: required_capability must be a capability name or None")
    return capability


def carries_stage_identity(name: str) -> bool:
    """Whether the installed connector ``name`` declares ``carries_stage_identity = True``: its messages name
    each item's layer and ``stage i of n`` and the FFN side pairs by them (optional class attribute, default
    False), which afd-mrv2's micro-batching (``afd.ubatch``) needs of the connector on the vLLM path."""
    return getattr(_connector_factory(name), "carries_stage_identity", False) is True


def required_capabilities(config: AfdConfig, *, v2_runner: bool = False) -> tuple[str, ...]:
    """What the runtime pair must grant for ``config`` on the vLLM path.

    ``moe_seam`` always, ``mrv2`` only with the V2 runner (:func:`afd_mrv2.compat.vllm_path_capabilities`),
    ``ubatch_runner`` for a micro-batched Attention role (``afd.ubatch``), then multistream and the
    connector's own capability.
    """
    caps = list(vllm_path_capabilities(v2_runner=v2_runner))
    if config.role == ATTENTION and config.ubatch.enabled:  # afd-mrv2's micro-batch runner on MRV2
        caps.append("ubatch_runner")
    if config.multistream.active_for(config.role):
        caps.append("multistream_ffn")
    needed = connector_capability(config.connector)
    if needed is not None:
        caps.append(needed)
    return tuple(caps)


# ------------------------------------------------------------------ CONFIG


def _section(subject: Subject) -> None:
    subject.config  # noqa: B018 - parsing is the check


def _connector_installed(subject: Subject) -> None:
    name = subject.config.connector
    points = entry_points()  # names only: nothing is imported
    if name not in points:
        raise PluginError(
            f"afd.connector: {name!r} is not installed; installed connectors: {', '.join(sorted(points)) or 'none'}"
        )


def _plugins(subject: Subject) -> None:
    check_plugins(subject.config)  # loaded (not built), of the right kind, of a hook API version served here


def _stage_identity(subject: Subject) -> None:
    config = subject.config
    if config.role == ATTENTION and config.ubatch.enabled and not carries_stage_identity(config.connector):
        raise ConfigError(
            "afd.ubatch.num_ubatches",
            f"connector {config.connector!r} does not declare carries_stage_identity: its messages cannot say "
            f"which of {config.ubatch.num_ubatches} micro-batches an item belongs to (torch_p2p can); "
            "set num_ubatches to 1",
        )


def _ubatch_section(subject: Subject) -> None:
    config = subject.config
    if not (config.ubatch.enabled and config.role == ATTENTION):
        return
    n = config.ubatch.num_ubatches
    if config.async_moe.enabled:
        raise ConfigError(
            "afd.ubatch.num_ubatches", "async-MoE stages (afd.async_moe) split the same batch; enable one of the two"
        )
    for name, threshold in (
        ("decode_token_threshold", config.ubatch.decode_token_threshold),
        ("prefill_token_threshold", config.ubatch.prefill_token_threshold),
    ):
        if threshold < n:
            raise ConfigError(
                f"afd.ubatch.{name}",
                f"expected at least num_ubatches ({n}): a step of fewer tokens would leave a micro-batch empty, "
                f"got {threshold}",
            )
    inputs, outputs = config.multistream.buffer_counts
    if inputs + outputs < n:
        raise ConfigError(
            "afd.ubatch.num_ubatches",
            f"{n} micro-batches keep {n} round trips in flight, but afd.multistream holds {inputs} + {outputs} "
            "exchange buffers; raise afd.multistream.depth",
        )


def _router_on_attention(subject: Subject) -> None:
    if not subject.config.compute_gate_on_attention:
        raise ConfigError(
            "afd.compute_gate_on_attention",
            "expected true on the vLLM path: vLLM's MoE runner computes the router on the attention side "
            "before the routed-experts seam, so the FFN receives top-k ids and weights, got false",
        )


# ------------------------------------------------------------------ RUNTIME


def _runtime_pair(subject: Subject) -> None:
    required = required_capabilities(subject.config, v2_runner=subject.v2_runner)
    decision = (subject.gate or check_runtime)(required)
    if not decision.accepted:
        raise CompatRefused(decision)


# ------------------------------------------------------------------ VLLM_CONFIG


def _matrix(rule: Rule) -> Check:
    def run(subject: Subject) -> None:
        rule.check(subject.config, subject.deployment)

    return Check(rule.name, Stage.VLLM_CONFIG, "VllmConfig: " + ", ".join(rule.facts), run)


def _seam_microbatching(subject: Subject) -> None:
    deployment = subject.deployment
    if deployment.native_dbo:
        raise ConfigError(
            "afd",
            f"vLLM native micro-batching ({deployment.num_ubatches} micro-batches per step, --enable-dbo / "
            "--ubatch-size) cannot run with AFD on vLLM's MoE seam; leave it off and use afd.ubatch.num_ubatches "
            "(afd-mrv2 serve --ubatches N)",
        )


def _attention_group(subject: Subject) -> None:
    """An Attention engine's DP x TP ranks are one lock-step group of ``afd.attention_group_size`` ranks."""
    config, deployment = subject.config, subject.deployment
    if config.role != ATTENTION:
        return
    known_fact(deployment, "afd.attention_group_size", "data_parallel_size", "tensor_parallel_size")
    dp, tp = deployment.data_parallel_size, deployment.tensor_parallel_size
    if dp * tp > 1:  # each process's own AFD rank comes from these (process_rank)
        known_fact(deployment, "afd.attention_group_size", "data_parallel_rank", "tensor_parallel_rank")
    if dp * tp != config.attention_group_size:
        raise ConfigError(
            "afd.attention_group_size",
            f"this Attention engine runs data_parallel_size {dp} x tensor_parallel_size {tp} = {dp * tp} ranks in "
            f"lock-step, one group; the section says {config.attention_group_size}: set it to {dp * tp} "
            "(afd-mrv2 serve does)",
        )
    if deployment.sequence_parallel and dp * tp > 1:
        raise ConfigError(
            "afd.attention_group_size",
            "sequence-parallel MoE needs expert parallelism among the Attention ranks, which hold no expert with "
            "AFD; leave it off",
        )


def _lora(subject: Subject) -> None:
    """Both roles: the MoE seam's stand-in and the FFN role's experts serve no adapter (and the stand-in's
    ``supports_internal_mk``, which LoRA's MoE layer reads, would mislead it)."""
    deployment = subject.deployment
    known_fact(deployment, "afd", "lora")
    if deployment.lora:
        raise ConfigError("afd", "LoRA adapters (--enable-lora) are not served with AFD: start the engine without them")


def _elastic_ep(subject: Subject) -> None:
    """Elastic EP re-stages a quant method that says ``supports_internal_mk``: the stand-in has no kernel to
    re-stage, and AFD's expert placement is its own."""
    deployment = subject.deployment
    known_fact(deployment, "afd", "elastic_ep")
    if deployment.elastic_ep:
        raise ConfigError(
            "afd",
            "elastic expert parallelism (--enable-elastic-ep) is not served with AFD: start the engine without it",
        )


# ------------------------------------------------------------------ MODEL

_MOE_ONLY = (
    "AFD splits each MoE layer between Attention and FFN ranks, so it serves MoE models only "
    "(Mixtral, Qwen2-MoE, DeepSeek-V2, ...)"
)


def _routed_experts(subject: Subject) -> None:
    model = subject.model
    if model is None:
        return
    archs = ", ".join(model.architectures or ("unknown architecture",))
    if model.num_experts <= 0:
        raise ConfigError("afd", f"the model ({archs}) has no routed-experts layer: {_MOE_ONLY}")
    if model.moe_layers == 0:
        layers = "" if model.layers is None else f" {model.layers}"
        raise ConfigError(
            "afd",
            f"the model ({archs}) has no routed-experts layer: its config gives {model.num_experts} routed experts, "
            f"but none of the{layers} layers vLLM builds of it is a MoE layer (mlp_only_layers, "
            f"decoder_sparse_step or the like); {_MOE_ONLY}",
        )


def _expert_placement(subject: Subject) -> None:
    """The model's routed experts placed on the FFN ranks: ``afd.placement``'s table places as many experts as
    the model has, or the ring has at least one expert for every FFN rank (any ``E``, balanced blocks)."""
    model = subject.model
    if model is None or model.num_experts <= 0:
        return
    subject.config.placement_for(model.num_experts)


#: Every admission check, in the order they run (the first refusal wins).
CHECKS: tuple[Check, ...] = (
    Check("afd-section", Stage.CONFIG, "additional_config['afd'], every key (afd_mrv2.config)", _section),
    Check(
        "connector-installed",
        Stage.CONFIG,
        "afd.connector; the names in entry-point group afd_mrv2",
        _connector_installed,
    ),
    Check(
        "plugins",
        Stage.CONFIG,
        "afd.connector, afd.observers: each entry point loaded (not built), its kind and hook_api_version",
        _plugins,
    ),
    Check(
        "stage-identity",
        Stage.CONFIG,
        "afd.role, afd.ubatch.num_ubatches; the connector's carries_stage_identity",
        _stage_identity,
    ),
    Check(
        "ubatch-section",
        Stage.CONFIG,
        "afd.role, afd.ubatch (num_ubatches, token thresholds), afd.async_moe.enabled, afd.multistream buffers",
        _ubatch_section,
    ),
    Check("router-on-attention", Stage.CONFIG, "afd.compute_gate_on_attention", _router_on_attention),
    Check(
        "runtime-pair",
        Stage.RUNTIME,
        "the installed torch / vLLM / vLLM-Ascend (afd_mrv2.compat) against the capabilities the section needs",
        _runtime_pair,
    ),
    *(_matrix(rule) for rule in RULES),
    Check("seam-native-ubatching", Stage.VLLM_CONFIG, "VllmConfig: native_dbo, num_ubatches", _seam_microbatching),
    Check(
        "seam-attention-group",
        Stage.VLLM_CONFIG,
        "afd.role, afd.attention_group_size; VllmConfig: data_parallel_size, tensor_parallel_size, their ranks, "
        "sequence_parallel",
        _attention_group,
    ),
    Check("seam-lora", Stage.VLLM_CONFIG, "VllmConfig: lora_config", _lora),
    Check("seam-elastic-ep", Stage.VLLM_CONFIG, "VllmConfig: parallel_config.enable_elastic_ep", _elastic_ep),
    Check(
        "routed-experts",
        Stage.MODEL,
        "the MoE layers the model builds, else its config's routed-expert count",
        _routed_experts,
    ),
    Check(
        "expert-placement",
        Stage.MODEL,
        "the routed-expert count; afd.num_ffn_ranks, afd.expert_replicas, afd.placement",
        _expert_placement,
    ),
)
NAMES = frozenset(check.name for check in CHECKS)


def run(
    subject: Subject, stages: Collection[Stage] = tuple(Stage), *, names: Collection[str] | None = None
) -> AfdConfig:
    """Run the checks of ``stages`` (those of them named ``names``, if given) in :data:`CHECKS` order.

    Returns the parsed section; the first refusal raises (one line naming the key).  Creates nothing.
    """
    if names is not None and not NAMES.issuperset(names):
        raise ValueError(f"no admission check named {', '.join(sorted(set(names) - NAMES))}")
    for check in CHECKS:
        if check.stage in stages and (names is None or check.name in names):
            check.run(subject)
    return subject.config


# ------------------------------------------------------------------ a checkpoint's config.json, without vLLM

#: The ``config.json`` keys vLLM reads a model's routed-expert count from (``ModelConfig.get_num_experts``,
#: vLLM 0.32/0.33), in its order: a list value counts its first element.
EXPERT_COUNT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


def _expert_count(raw: Mapping[str, Any]) -> int | None:
    for section in (raw, raw.get("text_config")):
        if not isinstance(section, Mapping):
            continue
        for key in EXPERT_COUNT_KEYS:
            value = section.get(key)
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int) and value > 0:
                return value
    return 0 if "expert" not in json.dumps(raw) else None


def checkpoint_facts(model: str) -> ModelFacts | None:
    """A local checkpoint's :class:`ModelFacts` from its ``config.json``, without vLLM (serve's first,
    second-long look); layers unknown.

    None (undecided: vLLM decides, in serve's pre-flight child and in every role) unless the routed-expert
    count is under one of :data:`EXPERT_COUNT_KEYS` (top level, or ``text_config``), or no key of the config
    mentions experts at all (a dense model: 0 experts); None too where there is no readable ``config.json``.
    """
    path = Path(model).expanduser() / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    experts = _expert_count(raw)
    if experts is None:
        return None
    return ModelFacts(tuple(raw.get("architectures") or ()), experts)
