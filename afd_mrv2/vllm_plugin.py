"""The vLLM general plugin: ``[project.entry-points."vllm.general_plugins"] afd_mrv2``.

vLLM calls every general plugin's entry point with **no arguments**, in every
process it starts (front end, engine core, each worker), possibly more than once,
and before any ``VllmConfig`` exists in that process.  So ``register()``:

* registers afd-mrv2's out-of-tree replacement of vLLM's ``RoutedExperts`` layer
  (:func:`afd_mrv2.mrv2.attention.experts.register_routed_experts`), idempotently; the
  layer itself reads ``additional_config["afd"]`` when vLLM constructs it and is
  exactly upstream without an ``afd`` section;
* does that only where vLLM is importable: with no vLLM installed it imports
  nothing and does nothing; where vLLM lacks the seam (another version), or
  another plugin already replaced ``RoutedExperts``, it logs a warning and leaves
  vLLM as it is: it never raises for an environment it does not serve.

``register(additional_config)`` additionally validates an ``afd`` section
(:func:`afd_mrv2.validation.validate`), for callers that hold the config
(launchers, tests, a CI step).

This module sits above :mod:`afd_mrv2.mrv2` (it registers a class from there);
the validation it shares with the runners lives below, in :mod:`afd_mrv2.validation`
(re-exported here for existing callers).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping

from afd_mrv2.config import AfdConfig
from afd_mrv2.validation import Gate, connector_capability, required_capabilities, validate

__all__ = ["Gate", "connector_capability", "register", "required_capabilities", "validate"]

log = logging.getLogger(__name__)


def _register_moe_seam() -> None:
    if importlib.util.find_spec("vllm") is None:
        return  # no vLLM here: nothing to register
    try:
        from afd_mrv2.mrv2.attention.experts import register_routed_experts
    except ImportError as exc:  # a vLLM without the seam this release needs
        log.warning("afd-mrv2: vLLM's RoutedExperts seam is not available (%s); AFD is off in this process", exc)
        return
    outcome = register_routed_experts()
    if outcome.startswith("owned by"):
        log.warning("afd-mrv2: RoutedExperts is already replaced (%s); AFD is off in this process", outcome)
    else:
        log.debug("afd-mrv2: RoutedExperts replacement %s", outcome)


def register(additional_config: Mapping[str, object] | None = None) -> AfdConfig | None:
    """vLLM's entry point (called with no arguments); see the module docstring."""
    config = validate(additional_config) if additional_config is not None else None
    _register_moe_seam()
    return config
