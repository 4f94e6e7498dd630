"""The vLLM general plugin: ``[project.entry-points."vllm.general_plugins"] afd_mrv2``.

``register()`` installs the ``RoutedExperts`` replacement where vLLM is importable, except on a platform
that registers its own (vLLM-Ascend: :data:`PLATFORMS_WITH_OWN_MOE_LAYER`), and, wherever the replacement is,
the ``afd`` load format (:mod:`afd_mrv2.mrv2.loader`) and the FFN role's experts-only model
(:mod:`afd_mrv2.mrv2.ffn.model`); it never raises.

See docs/internals/vllm-roles.md, "afd_mrv2.vllm_plugin".
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping

from afd_mrv2.compat.detect import PLATFORMS_WITH_OWN_MOE_LAYER, platform_with_own_moe_layer, replaces_routed_experts
from afd_mrv2.config import AfdConfig
from afd_mrv2.validation import Gate, connector_capability, required_capabilities, validate

__all__ = [
    "PLATFORMS_WITH_OWN_MOE_LAYER",
    "Gate",
    "connector_capability",
    "register",
    "replaces_routed_experts",
    "required_capabilities",
    "validate",
]

log = logging.getLogger(__name__)


def _register_moe_seam() -> None:
    if importlib.util.find_spec("vllm") is None:
        return  # no vLLM here: nothing to register
    owner = platform_with_own_moe_layer()
    if owner is not None:  # decided before any vLLM import: the process stays the platform's
        log.info("afd-mrv2: the %s platform registers its own RoutedExperts; afd-mrv2 registers none", owner)
        return
    try:
        from afd_mrv2.mrv2.attention.experts import register_routed_experts
    except ImportError as exc:  # a vLLM without the seam this release needs
        log.warning("afd-mrv2: vLLM's RoutedExperts seam is not available (%s); AFD is off in this process", exc)
        return
    outcome = register_routed_experts()
    if outcome.startswith("owned by"):
        log.warning("afd-mrv2: RoutedExperts is already replaced (%s); AFD is off in this process", outcome)
        return
    log.debug("afd-mrv2: RoutedExperts replacement %s", outcome)
    try:
        from afd_mrv2.mrv2.loader import register_afd_load_format
    except ImportError as exc:  # a vLLM without the loader seams: every expert tensor is read, none is held
        log.warning("afd-mrv2: vLLM's model-loader seam is not available (%s); no load format 'afd'", exc)
        return
    log.debug("afd-mrv2: load format 'afd' %s", register_afd_load_format())
    try:
        from afd_mrv2.mrv2.ffn.model import register_ffn_model
    except ImportError as exc:  # a vLLM without FusedMoEFactory: the FFN role builds the checkpoint's whole model
        log.warning("afd-mrv2: the FFN role's experts-only model is not available (%s)", exc)
        return
    log.debug("afd-mrv2: FFN experts-only model %s", register_ffn_model())


def register(additional_config: Mapping[str, object] | None = None) -> AfdConfig | None:
    """vLLM's entry point (called with no arguments); see docs/internals/vllm-roles.md."""
    config = validate(additional_config) if additional_config is not None else None
    _register_moe_seam()
    return config
