"""Async-MoE ubatching: the two-stage planner, stage-local metadata and stage pairing.

``plan_stages`` decides where a batch is cut; ``build_stage_metadata`` /
``split_tokens`` / ``merge_tokens`` rebuild and restore per-stage tensors;
``pairing`` keeps dispatch and combine of the same (layer, stage) together.
All pure functions over lists and tensors, so a runner can wire them in
without this package knowing about vLLM.
"""

from __future__ import annotations

from afd_mrv2.ubatch.metadata import PAD_SLOT_ID, StageMetadata, build_stage_metadata, merge_tokens, split_tokens
from afd_mrv2.ubatch.pairing import PairingError, PendingFifo, attention_items, ffn_items
from afd_mrv2.ubatch.planner import NUM_STAGES, SPLITS, Stage, plan_stages

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
    "merge_tokens",
    "plan_stages",
    "split_tokens",
]


def __getattr__(name: str) -> object:
    """``StageKey(layer, stage)``, removed in hook API 1: served one more API version as :meth:`WorkItem.stage`."""
    if name == "StageKey":
        import warnings

        from afd_mrv2.items import WorkItem

        warnings.warn(
            "afd_mrv2.ubatch.StageKey is deprecated since hook API 1: use afd_mrv2.WorkItem.stage(layer, stage)",
            DeprecationWarning,
            stacklevel=2,
        )
        return WorkItem.stage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
