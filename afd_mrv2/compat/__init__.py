"""Pinned runtime pairs, the compat decision, and upstream-seam contracts.

* :mod:`~afd_mrv2.compat.table`: the runtime-pair table (rows, capabilities, status);
* :mod:`~afd_mrv2.compat.detect`: what is installed, from metadata only;
* :mod:`~afd_mrv2.compat.decision`: accept (granting capabilities) or refuse, with the override;
* :mod:`~afd_mrv2.compat.seams` / :mod:`~afd_mrv2.compat.contracts`: the upstream symbols the
  shim relies on (vLLM-Ascend's in ``ascend_seams``), checked statically against a wheel, an
  installed distribution or an unpacked sdist, alone or stacked (``sources``).

Nothing in this package imports vllm, vllm_ascend, torch_npu or torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from afd_mrv2 import envs
from afd_mrv2.compat.decision import OVERRIDE_ENV, CompatRefused, Decision, decide
from afd_mrv2.compat.detect import Runtime, detect_runtime
from afd_mrv2.compat.table import CAPABILITIES, PAIRS, RuntimePair, Status

__all__ = [
    "CAPABILITIES",
    "OVERRIDE_ENV",
    "PAIRS",
    "V2_RUNNER_ENV",
    "CompatRefused",
    "Decision",
    "Runtime",
    "RuntimePair",
    "Status",
    "check_runtime",
    "decide",
    "detect_runtime",
    "v2_runner_selected",
    "vllm_path_capabilities",
]

#: vLLM's switch for ModelRunner V2 (:data:`afd_mrv2.envs.V2_MODEL_RUNNER`, ``VLLM_USE_V2_MODEL_RUNNER``).
V2_RUNNER_ENV = envs.V2_MODEL_RUNNER.name


def v2_runner_selected(env: Mapping[str, str] | None = None) -> bool:
    """True when the environment selects ModelRunner V2 (for callers that hold no vLLM config yet)."""
    return envs.v2_model_runner(env)


def vllm_path_capabilities(*, v2_runner: bool) -> tuple[str, ...]:
    """What AFD on the vLLM path needs from the runtime pair, before connector and multistream needs.

    ``moe_seam`` always (the out-of-tree RoutedExperts replacement carries AFD, whatever
    the runner); ``mrv2`` only when the V2 runner is selected (the Attention runner
    composes over it).
    """
    return ("moe_seam", "mrv2") if v2_runner else ("moe_seam",)


def check_runtime(require: tuple[str, ...] = ()) -> Decision:
    """Detect the installed runtime and decide on it."""
    return decide(detect_runtime(), require=require)
