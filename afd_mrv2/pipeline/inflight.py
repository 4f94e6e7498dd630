"""The items an executor issued and has not released yet, each with its ``done`` event.

An item's ``done`` event is recorded after its send; the events come from a
fixed pool (``depth_in + depth_out``: no more items are ever in flight, see
docs/internals/pipeline.md, "afd_mrv2.pipeline.executor") and go back when the item is released.  Items are
kept in issue order, so "release every completed item" stops at the first one
still running.
"""

from __future__ import annotations

from afd_mrv2.devices.base import Event
from afd_mrv2.work import Work


class InFlight:
    """Issued, not yet released work items, in issue order."""

    def __init__(self, events: list[Event]) -> None:
        self._free = events
        self._works: dict[int, Work] = {}  # seq -> work
        self._done: dict[int, Event] = {}  # seq -> the event recorded after its send
        self.sent: set[int] = set()  # seq of items whose on_send returned

    def __contains__(self, seq: int) -> bool:
        return seq in self._works

    @property
    def full(self) -> bool:
        """No ``done`` event left: the oldest item must be released first."""
        return not self._free

    def add(self, work: Work) -> Event:
        """Track ``work``; returns the ``done`` event its send stream must record."""
        event = self._done[work.item.seq] = self._free.pop()
        self._works[work.item.seq] = work
        return event

    def done_event(self, seq: int) -> Event | None:
        return self._done.get(seq)

    def pending(self) -> list[tuple[int, Event]]:
        """(seq, done event) of every tracked item, in issue order."""
        return list(self._done.items())

    def completed(self) -> list[int]:
        """The leading items whose ``done`` event completed (checked without blocking)."""
        out = []
        for seq, done in self._done.items():
            if not done.query():
                break
            out.append(seq)
        return out

    def release(self, seq: int) -> None:
        self._free.append(self._done.pop(seq))
        del self._works[seq]
        self.sent.discard(seq)

    def unsent(self) -> list[Work]:
        """Tracked items whose ``on_send`` has not returned, in issue order."""
        return [w for seq, w in self._works.items() if seq not in self.sent]

    def clear(self) -> None:
        self._free += self._done.values()
        self._done.clear()
        self._works.clear()
        self.sent.clear()
