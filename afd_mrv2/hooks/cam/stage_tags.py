"""Stage identity of CAM transfers: the side channel that carries it, and the check.

A stage identity is a :class:`~afd_mrv2.items.WorkItem` without its sequence number
(:meth:`WorkItem.stage`; text ``layer=L stage S of N``), afd-mrv2's one item identity.

With async-MoE stages an attention rank sends, per layer, one transfer per stage
(stage 0 of 2, then stage 1 of 2), and a step the planner cannot split runs as
one stage (stage 0 of 1).  The CAM operators' wire format is fixed: CAMAsync's
dispatch carries ``(source tokens, source rank, layer)`` and nothing about the
stage; CAMP2P's carries nothing but the rows (its stages are its per-stage HCCL
groups).  A receiver that *infers* the stage (the ``k``-th arrival of a
(source, layer) is stage ``k % S``; the group of stage ``s`` carries stage
``s``) silently pairs stage 0 of 2 with stage 0 of 1 when the two ranks split a
step differently.

So the identity travels beside the operators, on a :class:`StageTags` side
channel, and each receiving connector checks it against the work item it is
filling; a mismatch raises :class:`StageMismatch` naming both ranks and both
identities.  The protocol is two calls, made by the connectors:

* the sender, immediately before calling its send operator (CAMAsync
  ``async_dispatch_send`` / ``async_combine_send``, CAMP2P ``a2e`` / ``e2a``),
  :meth:`StageTags.stamp`\\ s the identity of the transfer that call sends;
* the receiver, once its receive operator returned and its outputs are readable,
  :meth:`StageTags.take`\\ s, per source rank, the identity of each transfer that
  call delivered from that source, in delivery order.

Providers:

* the CAM test doubles (:mod:`tests.support`) carry the stamped identity in
  each message's payload metadata (what a transport with a spare header word
  would do) and hand it to ``take`` when their receive operator delivers the
  message; their ``OpSet`` brings it (``OpSet.stage_tags``);
* a deployment may pass any :class:`StageTags` as the context field
  ``cam_stage_tags`` (for example one keyed by (source, destination, layer,
  ordinal) over a host store: CAM is FIFO per (source, destination, layer), so
  the ``k``-th arrival of a key pairs with the ``k``-th stamp of it; ``take``
  then blocks until that stamp arrived).  It takes precedence over the OpSet's;
* neither: the connectors fall back to the operators' ordering (CAMAsync: the
  ordinal of the arrival; CAMP2P: the stage's HCCL group) and assume every rank
  splits each step alike.  That is unchecked; where the real operators' ordering
  is relied on instead of a side channel is documented with the NPU probe
  (``docs/ascend-deployment.md``, ``afd-mrv2 probe npu``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from afd_mrv2.errors import PluginError
from afd_mrv2.items import WorkItem

#: Context field of a deployment's :class:`StageTags` (takes precedence over the OpSet's).
STAGE_TAGS_RESOURCE = "cam_stage_tags"


@runtime_checkable
class StageTags(Protocol):
    """The side channel the stage identity of CAM transfers travels on (see the module docstring)."""

    def stamp(self, sender: int, stage: WorkItem) -> None:
        """World rank ``sender``'s next send-operator call carries ``stage``; call right before it, on its thread."""
        ...

    def take(self, receiver: int, sender: int) -> WorkItem | None:
        """The identity of the oldest transfer from ``sender`` that ``receiver``'s receive operator delivered and
        that was not taken yet; None when that transfer carried none (its sender stamped nothing)."""
        ...


class StageMismatch(PluginError):
    """A transfer's stage identity is not the one the receiving work item expects."""

    def __init__(self, message: str, *, sender: WorkItem | None, expected: WorkItem) -> None:
        super().__init__(message)
        self.sender = sender
        self.expected = expected


def check_stage(
    got: WorkItem | None, expected: WorkItem, *, connector: str, what: str, sender_name: str, receiver_name: str
) -> None:
    """Raise :class:`StageMismatch` naming both sides unless ``got`` is ``expected`` (stage identities,
    :meth:`WorkItem.stage`: layer and ``stage i of n``)."""
    if expected.same_stage(got):
        return
    sent = (
        "no stage identity (none was delivered: its sender stamped none, or the receive operator's outputs were "
        "read before it delivered)"
        if got is None
        else str(got)
    )
    raise StageMismatch(
        f"{connector}: stage identity mismatch on {what}: {sender_name} sent {sent}, but {receiver_name} expects "
        f"{expected}; both sides must split each step into the same stages and issue them in the same order",
        sender=got,
        expected=expected,
    )


def __getattr__(name: str) -> object:
    """``StageId(layer, stage, num_stages)``, removed in hook API 1: served one more API version as
    :meth:`WorkItem.stage` (its fields are ``layer_idx`` / ``stage_idx`` / ``num_stages``)."""
    if name == "StageId":
        import warnings

        warnings.warn(
            "afd_mrv2.hooks.cam.stage_tags.StageId is deprecated since hook API 1: use "
            "afd_mrv2.WorkItem.stage(layer, stage, num_stages)",
            DeprecationWarning,
            stacklevel=2,
        )
        return WorkItem.stage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
