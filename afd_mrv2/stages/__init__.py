"""The stages of a step: the async-MoE two-stage planner, stage-local metadata and stage pairing.

``plan_stages`` decides where a batch is cut; ``build_stage_metadata`` /
``split_tokens`` / ``merge_tokens`` rebuild and restore per-stage tensors;
``pairing`` keeps dispatch and combine of the same (layer, stage) together.
All pure functions over lists and tensors, so a runner can wire them in
without this package knowing about vLLM.  (vLLM micro-batching, the other way a step
is cut into stages, is :mod:`afd_mrv2.mrv2.attention.ubatch_runner` and ``afd.ubatch``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from afd_mrv2.stages.pairing import PairingError, PendingFifo, attention_items, ffn_items
from afd_mrv2.stages.planner import NUM_STAGES, SPLITS, Stage, plan_stages

if TYPE_CHECKING:
    from afd_mrv2.stages.metadata import PAD_SLOT_ID, StageMetadata, build_stage_metadata, merge_tokens, split_tokens

#: the names of :mod:`afd_mrv2.stages.metadata`, which imports torch: loaded on first use, so that a process
#: that only plans (the ``afd-mrv2 run`` launcher, serve) never imports torch through this package
_METADATA = ("PAD_SLOT_ID", "StageMetadata", "build_stage_metadata", "merge_tokens", "split_tokens")

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


def __getattr__(name: str) -> Any:
    if name in _METADATA:
        from afd_mrv2.stages import metadata

        return getattr(metadata, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
