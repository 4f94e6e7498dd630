"""The executor's event pool: every event is created up front, none in the steady state."""

from __future__ import annotations

from afd_mrv2.devices.base import DeviceBackend, Event


class EventPool:
    """A fixed set of events created at start-up and handed out by ``take``.

    The executor takes one event per edge per slot (3 x depth) when it is built;
    taking more than the pool holds is a programming error, reported loudly
    instead of silently allocating on the hot path.
    """

    def __init__(self, backend: DeviceBackend, size: int) -> None:
        self._free: list[Event] = [backend.new_event() for _ in range(size)]
        self.size = size

    def take(self) -> Event:
        if not self._free:
            raise RuntimeError(
                f"event pool exhausted (size {self.size}): the executor allocates no events after start-up"
            )
        return self._free.pop()

    @property
    def available(self) -> int:
        return len(self._free)
