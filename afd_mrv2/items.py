"""The identity of pipelined work and the names of its phases and roles (a leaf: imports nothing of afd_mrv2)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The three phases of every work item, in pipeline order (also the executor's stream roles).
PHASES = ("recv", "compute", "send")

#: The two AFD roles (``afd.role``); the rank layout is :mod:`afd_mrv2.topology`'s.
ATTENTION = "attention"
FFN = "ffn"


#: The ``seq`` of a stage identity (:meth:`WorkItem.stage`): any sequence number.
ANY_SEQ = -1


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

    This is afd-mrv2's one item and stage identity, with one text form: ``str(item)``
    (``layer=L stage=S seq=N``).  A **stage identity** is the same class with ``seq`` =
    :data:`ANY_SEQ` (:meth:`stage`, :attr:`stage_id`): what two ranks that number their
    items differently agree on, written ``layer=L stage S of N``.  The torch_p2p wire
    header carries an item's fields (:func:`afd_mrv2.hooks.p2p.wire.item_header`), the CAM
    stage tags and the connectors' pending transfers carry stage identities.
    """

    layer_idx: int
    stage_idx: int
    seq: int
    num_stages: int = field(default=1, compare=False)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"WorkItem num_stages must be >= 1, got {self.num_stages}")

    @classmethod
    def stage(cls, layer_idx: int, stage_idx: int, num_stages: int = 1) -> WorkItem:
        """The stage identity (layer, stage i of n), whatever the sequence number."""
        return cls(layer_idx, stage_idx, ANY_SEQ, num_stages)

    @property
    def stage_id(self) -> WorkItem:
        """This item's stage identity: its layer and ``stage i of n``, without its sequence number."""
        return WorkItem.stage(self.layer_idx, self.stage_idx, self.num_stages)

    def same_stage(self, other: WorkItem | None) -> bool:
        """Whether ``other`` names the same layer and ``stage i of n`` (stage count included, unlike ``==``)."""
        return other is not None and (self.layer_idx, self.stage_idx, self.num_stages) == (
            other.layer_idx,
            other.stage_idx,
            other.num_stages,
        )

    @property
    def stage_name(self) -> str:
        """``stage i of n``: the stage identity connectors check on the wire."""
        return f"stage {self.stage_idx} of {self.num_stages}"

    def __str__(self) -> str:
        if self.seq == ANY_SEQ:
            return f"layer={self.layer_idx} {self.stage_name}"
        return f"layer={self.layer_idx} stage={self.stage_idx} seq={self.seq}"
