"""Deprecated alias of :mod:`afd_mrv2.stages` (renamed in 0.3.0; removed in the next version).

"ubatch" now means vLLM micro-batching only (``afd.ubatch``,
:mod:`afd_mrv2.mrv2.attention.ubatch_runner`); the async-MoE stage planner is
:mod:`afd_mrv2.stages`.  Importing this package, or any of its old submodules
(``afd_mrv2.ubatch.layout``, ``.metadata``, ``.pairing``, ``.planner``), warns once
and gives the same objects.
"""

from __future__ import annotations

import sys
import warnings

from afd_mrv2 import stages
from afd_mrv2.stages import (
    NUM_STAGES,
    PAD_SLOT_ID,
    SPLITS,
    PairingError,
    PendingFifo,
    Stage,
    StageMetadata,
    attention_items,
    build_stage_metadata,
    ffn_items,
    layout,
    merge_tokens,
    metadata,
    pairing,
    plan_stages,
    planner,
    split_tokens,
)

warnings.warn(
    "afd_mrv2.ubatch is deprecated since 0.3.0: import afd_mrv2.stages (the same names and submodules)",
    DeprecationWarning,
    stacklevel=2,
)

for _name in ("layout", "metadata", "pairing", "planner"):
    sys.modules[f"{__name__}.{_name}"] = getattr(stages, _name)

__all__ = [
    "NUM_STAGES",
    "PAD_SLOT_ID",
    "SPLITS",
    "PairingError",
    "PendingFifo",
    "Stage",
    "StageMetadata",
    "attention_items",
    "build_stage_metadata",
    "ffn_items",
    "layout",
    "merge_tokens",
    "metadata",
    "pairing",
    "plan_stages",
    "planner",
    "split_tokens",
]


def __getattr__(name: str) -> object:
    """``StageKey(layer, stage)``, removed in hook API 1: served one more API version as :meth:`WorkItem.stage`."""
    if name == "StageKey":
        from afd_mrv2.items import WorkItem

        warnings.warn(
            "afd_mrv2.ubatch.StageKey is deprecated since hook API 1: use afd_mrv2.WorkItem.stage(layer, stage)",
            DeprecationWarning,
            stacklevel=2,
        )
        return WorkItem.stage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
