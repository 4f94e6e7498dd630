"""The vLLM general plugin: ``[project.entry-points."vllm.general_plugins"] afd_mrv2``.

How ``register()`` sees the config (a decision, from reading vLLM 0.30.0 / 0.33.0)
---------------------------------------------------------------------------------
vLLM calls every general plugin with **no arguments** (``vllm.plugins.load_general_plugins``)
in every process: while the front end parses arguments (``EngineArgs``, before a
``VllmConfig`` exists), at the top of ``EngineCore.__init__`` and in
``WorkerWrapperBase.init_worker`` (before the worker is built;
``set_current_vllm_config`` is entered only later, in ``load_model``).  At none of
these points can a plugin reach ``VllmConfig.additional_config``.  So:

* ``register()`` (no arguments, as vLLM calls it) only marks the plugin loaded:
  idempotent, touches nothing, imports neither vllm nor torch, never raises;
* the validation runs where the config is in hand, **before any communication
  resource exists**: the Attention runner's constructor (and afd-mrv2's worker
  factory) call :func:`validate` with ``vllm_config.additional_config`` before
  constructing the upstream runner.  ``register(additional_config)`` is the same
  check, for callers that have the config (tests, launchers, a CI step).

No ``afd`` section: nothing happens (vLLM loads every installed general plugin,
so this plugin must be harmless for deployments it does not serve).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from afd_mrv2.compat import CompatRefused, Decision, check_runtime
from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.errors import PluginError
from afd_mrv2.plugins import entry_points, require_installed

log = logging.getLogger(__name__)

Gate = Callable[[tuple[str, ...]], Decision]

_registered = False


def connector_capability(name: str) -> str | None:
    """The runtime-pair capability the installed connector ``name`` declares, if any.

    A connector factory declares it as the class attribute ``required_capability``
    (a capability name of :mod:`afd_mrv2.compat`, or None); built-in and
    third-party connectors alike.  Loading the entry point imports the connector's
    module, nothing more: no connector object is built.
    """
    point = entry_points().get(name)
    if point is None:
        return None
    try:
        factory = point.load()
    except Exception as exc:
        raise PluginError(f"connector {name!r} failed to load from {point.value!r}: {exc}") from exc
    capability = getattr(factory, "required_capability", None)  # optional: most connectors need none
    if capability is not None and not isinstance(capability, str):
        raise PluginError(f"connector {name!r}: required_capability must be a capability name or None")
    return capability


def required_capabilities(config: AfdConfig) -> tuple[str, ...]:
    """What the runtime pair must grant for ``config``."""
    caps = ["mrv2"]
    if config.multistream.active_for(config.role):
        caps.append("multistream_ffn")
    needed = connector_capability(config.connector)
    if needed is not None:
        caps.append(needed)
    return tuple(caps)


def validate(additional_config: object, *, gate: Gate | None = None) -> AfdConfig | None:
    """Parse and check the ``afd`` section; None when there is none.

    Raises :class:`~afd_mrv2.errors.ConfigError` (bad config, naming the key),
    :class:`~afd_mrv2.errors.PluginError` (connector not installed) or
    :class:`~afd_mrv2.compat.CompatRefused` (runtime pair refused), in that order,
    and creates nothing.
    """
    if not isinstance(additional_config, Mapping) or "afd" not in additional_config:
        return None
    config = parse_afd_config(additional_config["afd"])
    require_installed(entry_points(), config.connector, "connector", key="afd.connector")
    decision = (gate or check_runtime)(required_capabilities(config))
    if not decision.accepted:
        raise CompatRefused(decision)
    return config


def register(additional_config: Mapping[str, object] | None = None) -> AfdConfig | None:
    """vLLM's entry point (called with no arguments); see the module docstring."""
    global _registered
    config = validate(additional_config) if additional_config is not None else None
    if not _registered:
        _registered = True
        log.debug("afd-mrv2 general plugin loaded; AFD config is validated when the model runner is built")
    return config
