"""Pinned runtime pairs, the compat decision, and upstream-seam contracts.

* :mod:`~afd_mrv2.compat.table`: the runtime-pair table (rows, capabilities, status);
* :mod:`~afd_mrv2.compat.detect`: what is installed, from metadata only;
* :mod:`~afd_mrv2.compat.decision`: accept (granting capabilities) or refuse, with the override;
* :mod:`~afd_mrv2.compat.seams` / :mod:`~afd_mrv2.compat.contracts`: the upstream symbols the
  shim relies on, checked statically against a wheel or an installed distribution.

Nothing in this package imports vllm, vllm_ascend, torch_npu or torch.
"""

from __future__ import annotations

from afd_mrv2.compat.decision import OVERRIDE_ENV, CompatRefused, Decision, decide
from afd_mrv2.compat.detect import Runtime, detect_runtime
from afd_mrv2.compat.table import CAPABILITIES, PAIRS, RuntimePair, Status

__all__ = [
    "CAPABILITIES",
    "OVERRIDE_ENV",
    "PAIRS",
    "CompatRefused",
    "Decision",
    "Runtime",
    "RuntimePair",
    "Status",
    "check_runtime",
    "decide",
    "detect_runtime",
]


def check_runtime(require: tuple[str, ...] = ()) -> Decision:
    """Detect the installed runtime and decide on it."""
    return decide(detect_runtime(), require=require)
