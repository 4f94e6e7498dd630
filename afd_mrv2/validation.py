"""Validation of ``additional_config["afd"]`` against the installed connectors and runtime pair.

The ``CONFIG`` and ``RUNTIME`` checks of :mod:`afd_mrv2.admission`, for callers that hold no
vLLM config yet: the general plugin's ``register(additional_config)``
(:mod:`afd_mrv2.vllm_plugin`) and the worker factory.  It sits below :mod:`afd_mrv2.mrv2` so
that the plugin entry point can sit above it (the plugin registers the MoE-seam layer class
that lives in ``mrv2``).  Nothing here creates a stream, thread or communication resource: a
bad config raises :class:`~afd_mrv2.errors.ConfigError` naming the key, a connector that is
not installed :class:`~afd_mrv2.errors.PluginError`, a refused runtime pair
:class:`~afd_mrv2.compat.CompatRefused`, in that order.
"""

from __future__ import annotations

from afd_mrv2.admission import (
    Gate,
    Stage,
    Subject,
    afd_section,
    carries_stage_identity,
    connector_capability,
    required_capabilities,
    run,
)
from afd_mrv2.compat import v2_runner_selected
from afd_mrv2.config import AfdConfig

__all__ = [
    "Gate",
    "afd_section",
    "carries_stage_identity",
    "check_ubatch_connector",
    "connector_capability",
    "parse_installed",
    "required_capabilities",
    "validate",
]


def check_ubatch_connector(config: AfdConfig) -> None:
    """Refuse micro-batching on the Attention role with a connector that cannot carry the stage identity
    (the admission check ``stage-identity``)."""
    run(Subject(config), names=("stage-identity",))


def parse_installed(additional_config: object) -> AfdConfig | None:
    """The ``CONFIG`` checks of the ``afd`` section (parsed, its plugins installed); None when there is none.

    No runtime-pair decision: for callers whose capability needs are decided elsewhere
    (the model-side MoE seam runs under whatever runner vLLM chose).
    """
    raw = afd_section(additional_config)
    return None if raw is None else run(Subject(raw), (Stage.CONFIG,))


def validate(additional_config: object, *, gate: Gate | None = None, v2_runner: bool | None = None) -> AfdConfig | None:
    """The ``CONFIG`` then ``RUNTIME`` checks of the ``afd`` section; None when there is none.

    ``v2_runner``: whether ModelRunner V2 is selected (then ``mrv2`` is required); None
    reads ``VLLM_USE_V2_MODEL_RUNNER`` (:func:`afd_mrv2.compat.v2_runner_selected`).
    """
    raw = afd_section(additional_config)
    if raw is None:
        return None
    v2 = v2_runner_selected() if v2_runner is None else v2_runner
    return run(Subject(raw, v2_runner=v2, gate=gate), (Stage.CONFIG, Stage.RUNTIME))
