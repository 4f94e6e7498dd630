"""The identity of pipelined work and the names of its phases and roles (a leaf: imports nothing of afd_mrv2)."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    ``num_stages`` is how many stages the item's step was split into (1: the step
    ran unsplit).  It is not part of the identity (equality, hash and order use
    ``(layer_idx, stage_idx, seq)``): it is what a connector puts on the wire
    beside the stage index, so that a peer whose step was split differently (one
    rank ran it unsplit, the other in two stages) fails loudly instead of pairing
    stage 0 of 2 with stage 0 of 1.  Owners that split steps set it from their
    schedule; the default 1 is an unsplit step.
    """

    layer_idx: int
    stage_idx: int
    seq: int
    num_stages: int = field(default=1, compare=False)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"WorkItem num_stages must be >= 1, got {self.num_stages}")

    @property
    def stage_name(self) -> str:
        """``stage i of n``: the stage identity connectors check on the wire."""
        return f"stage {self.stage_idx} of {self.num_stages}"

    def __str__(self) -> str:
        return f"layer={self.layer_idx} stage={self.stage_idx} seq={self.seq}"
