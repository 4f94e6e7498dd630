"""Stage identity of CAM transfers: the side channel that carries it, and the check.

:class:`StageTags` (``stamp`` / ``take``) and :class:`StageMismatch`; see also
docs/ascend-deployment.md, "Stage identity on the CAM wire".

See docs/internals/cam-connectors.md, "afd_mrv2.hooks.cam.stage_tags".
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from afd_mrv2.errors import PluginError
from afd_mrv2.items import WorkItem

#: Context field of a deployment's :class:`StageTags` (takes precedence over the OpSet's).
STAGE_TAGS_RESOURCE = "cam_stage_tags"


@runtime_checkable
class StageTags(Protocol):
    """The side channel the stage identity of CAM transfers travels on (see docs/internals/cam-connectors.md)."""

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
