"""Validation of ``additional_config["afd"]`` against the installed connectors and runtime pair.

Shared by everything that holds a vLLM config: the Attention runner
(:mod:`afd_mrv2.mrv2.attention.runner`), the worker factory (:mod:`afd_mrv2.mrv2.attention.worker`),
the model-side MoE seam (:mod:`afd_mrv2.mrv2.attention.experts`) and the general plugin's
``register(additional_config)`` (:mod:`afd_mrv2.vllm_plugin`).  It sits below
:mod:`afd_mrv2.mrv2` so that the plugin entry point can sit above it (the plugin
registers the MoE-seam layer class that lives in ``mrv2``).

Everything here runs before any stream, thread or communication resource exists:
a bad config raises :class:`~afd_mrv2.errors.ConfigError` naming the key, a
connector that is not installed :class:`~afd_mrv2.errors.PluginError`, a refused
runtime pair :class:`~afd_mrv2.compat.CompatRefused`, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from afd_mrv2.compat import CompatRefused, Decision, check_runtime, v2_runner_selected, vllm_path_capabilities
from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.items import ATTENTION
from afd_mrv2.plugins import check_plugins, entry_points

#: The compat decision for a tuple of required capabilities (``check_runtime`` by default; tests pass their own).
Gate = Callable[[tuple[str, ...]], Decision]


def afd_section(additional_config: object) -> object | None:
    """The raw ``afd`` section of ``additional_config``, or None when there is none."""
    if not isinstance(additional_config, Mapping) or "afd" not in additional_config:
        return None
    return additional_config["afd"]


def _connector_factory(name: str) -> object | None:
    """The installed connector ``name``'s factory (loading the entry point imports its module, nothing more:
    no connector object is built), or None when it is not installed."""
    point = entry_points().get(name)
    if point is None:
        return None
    try:
        return point.load()
    except Exception as exc:
        raise PluginError(f"connector {name!r} failed to load from {point.value!r}: {exc}") from exc


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


def check_ubatch_connector(config: AfdConfig) -> None:
    """Refuse micro-batching on the Attention role with a connector that cannot carry the stage identity."""
    if config.role == ATTENTION and config.ubatch.enabled and not carries_stage_identity(config.connector):
        raise ConfigError(
            "afd.ubatch.num_ubatches",
            f"connector {config.connector!r} does not declare carries_stage_identity: its messages cannot say "
            f"which of {config.ubatch.num_ubatches} micro-batches an item belongs to (torch_p2p can); "
            "set num_ubatches to 1",
        )


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


def parse_installed(additional_config: object) -> AfdConfig | None:
    """Parse the ``afd`` section and check its connector is installed; None when there is none.

    No runtime-pair decision: for callers whose capability needs are decided elsewhere
    (the model-side MoE seam runs under whatever runner vLLM chose).
    """
    raw = afd_section(additional_config)
    if raw is None:
        return None
    config = parse_afd_config(raw)
    check_plugins(config)  # installed, of the right kind, written for a hook API version this package serves
    check_ubatch_connector(config)
    return config


def validate(additional_config: object, *, gate: Gate | None = None, v2_runner: bool | None = None) -> AfdConfig | None:
    """Parse and check the ``afd`` section, then the runtime pair; None when there is none.

    ``v2_runner``: whether ModelRunner V2 is selected (then ``mrv2`` is required); None
    reads ``VLLM_USE_V2_MODEL_RUNNER`` (:func:`afd_mrv2.compat.v2_runner_selected`).

    Raises :class:`~afd_mrv2.errors.ConfigError` (bad config, naming the key),
    :class:`~afd_mrv2.errors.PluginError` (connector not installed) or
    :class:`~afd_mrv2.compat.CompatRefused` (runtime pair refused), in that order,
    and creates nothing.
    """
    config = parse_installed(additional_config)
    if config is None:
        return None
    v2 = v2_runner_selected() if v2_runner is None else v2_runner
    decision = (gate or check_runtime)(required_capabilities(config, v2_runner=v2))
    if not decision.accepted:
        raise CompatRefused(decision)
    return config
