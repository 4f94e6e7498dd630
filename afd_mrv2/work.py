"""Slots and the per-item handle (``Work``) passed to the phase hooks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from afd_mrv2.devices.base import Event
from afd_mrv2.errors import PipelineAborted
from afd_mrv2.items import WorkItem


@dataclass(eq=False)
class Slot:
    """One of the executor's ``depth`` in-flight slots.

    A slot carries one work item at a time.  ``state`` belongs to the connector:
    it typically holds preallocated receive/send buffers and the connector's
    transfer state for the item currently bound to the slot; the executor never
    reads it.  The slot's events are the executor's (see ``SlotEvents``).
    """

    index: int
    events: SlotEvents
    state: Any = None
    item: WorkItem | None = None


@dataclass(eq=False)
class SlotEvents:
    """The three events that carry a slot's edges.

    recv_done -> compute may read the received inputs;
    compute_done -> send may read the outputs;
    send_done -> the slot (buffers, transfer state) may be reused.
    """

    recv_done: Event
    compute_done: Event
    send_done: Event

    def for_phase(self, phase: str) -> Event:
        return {"recv": self.recv_done, "compute": self.compute_done, "send": self.send_done}[phase]


@dataclass(eq=False)
class Work:
    """What a phase hook receives as ``work``: the item, its slot, and cancellation.

    ``Work`` objects are created by the executor, one per work item, and shared by
    the item's three phases.  Hooks may stash per-item data in ``scratch`` (for
    example the routing metadata the compute phase needs from the recv phase),
    but must not keep a reference to the ``Work`` after ``on_send`` returns.
    """

    item: WorkItem
    slot: Slot
    _cancel: threading.Event = field(repr=False)
    scratch: dict[str, Any] = field(default_factory=dict)

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
