"""The identity of pipelined work and the names of its phases and roles (a leaf: imports nothing of afd_mrv2)."""

from __future__ import annotations

from dataclasses import dataclass

#: The three phases of every work item, in pipeline order (also the executor's stream roles).
PHASES = ("recv", "compute", "send")

#: The two AFD roles (``afd.role``); the rank layout is :mod:`afd_mrv2.topology`'s.
ATTENTION = "attention"
FFN = "ffn"


@dataclass(frozen=True, order=True)
class WorkItem:
    """The identity of one unit of pipelined work: one (layer, stage, sequence number).

    ``stage_idx`` is the micro-batch (ubatch) or async-MoE stage; ``seq`` counts
    work items of one executor run (or of one engine step) and is what makes two
    items with the same layer and stage distinct.
    """

    layer_idx: int
    stage_idx: int
    seq: int

    def __str__(self) -> str:
        return f"layer={self.layer_idx} stage={self.stage_idx} seq={self.seq}"
