"""Buffer slots and the per-item handle (``Work``) passed to the phase hooks: :class:`BufferSlot`, :class:`Work`.

See docs/internals/hooks-api.md, "afd_mrv2.work".
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from afd_mrv2.devices.base import Event
from afd_mrv2.errors import PipelineAborted
from afd_mrv2.items import WorkItem

#: The two kinds of buffer slot, by who fills and who drains them.
INPUT, OUTPUT = "input", "output"


@dataclass(eq=False)
class BufferSlot:
    """One of the executor's input or output buffer slots.

    ``state`` belongs to the connector: the preallocated tensors of this slot
    (receive buffers in an input slot, send buffers in an output slot), allocated
    once on first use and reused; the executor never reads it, except to measure
    the bytes it holds.  The events are the executor's:

    ``ready``: the producer finished writing (input: recv done; output: compute done);
    ``free``: the consumer finished reading (input: compute done; output: send done),
    so the next item bound to this slot may overwrite it.
    """

    kind: str  # INPUT or OUTPUT
    index: int
    ready: Event
    free: Event
    state: Any = None
    item: WorkItem | None = None  # the item bound most recently (None: never used)


@dataclass(eq=False)
class Work:
    """What a phase hook receives as ``work``: the item, its two buffer slots, its transfer state.

    ``Work`` objects are created by the executor, one per work item, and shared by
    the item's three phases.

    * ``inputs``: the input slot; ``on_recv`` writes its buffers, ``on_compute`` reads them;
    * ``outputs``: the output slot; ``on_compute`` writes its buffers, ``on_send`` reads them;
    * ``transfer``: per-item transfer state that crosses phases (routing metadata,
      an operator's dispatch handle, dynamic scales): valid from ``on_recv`` until
      the item's ``on_send`` returned, never shared with another item.

    Hooks must not keep a reference to the ``Work`` after ``on_send`` returns.
    """

    item: WorkItem
    inputs: BufferSlot
    outputs: BufferSlot
    _cancel: threading.Event = field(repr=False)
    transfer: dict[str, Any] = field(default_factory=dict)
    #: served to a plugin written for hook API 0 (the executor held the input slot until send)
    _api0: bool = field(default=False, repr=False)

    @property
    def slot(self) -> BufferSlot:
        """Hook API 0's one slot per item; deprecated, use ``inputs`` and ``outputs``.

        Served only when a registered plugin was written for API 0: the executor then
        keeps the item's input slot until its send completed, API 0's lifetime of
        ``slot.state`` (from recv until the slot's next recv, after this item's send),
        and this returns that input slot.  For an API-1 plugin it raises.
        """
        if not self._api0:
            raise AttributeError(
                "Work.slot was removed in hook API 1: use work.inputs (what recv fills and compute reads) and "
                "work.outputs (what compute writes and send reads); plugins that declare no hook_api_version "
                "are served API 0's slot"
            )
        _deprecated("work.slot", "work.inputs and work.outputs (hook API 1)")
        return self.inputs

    @property
    def scratch(self) -> dict[str, Any]:
        """Hook API 0's per-item dict; deprecated, the same dict as ``transfer``."""
        _deprecated("work.scratch", "work.transfer (hook API 1)")
        return self.transfer

    @property
    def cancelled(self) -> bool:
        """True once the executor stopped (failure elsewhere, or close()).

        A hook that blocks (polling a receive, say) should check this between polls
        and return or raise promptly when it turns True.
        """
        return self._cancel.is_set()

    def raise_if_cancelled(self) -> None:
        """Raise :class:`PipelineAborted` if the executor has stopped."""
        if self._cancel.is_set():
            raise PipelineAborted(f"pipeline stopped while {self.item} was in flight", item=self.item)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated since hook API 1: use {new}", DeprecationWarning, stacklevel=3)
