"""Recording backend: deterministic, single-threaded, with an op log.

The happens-before checker replays ``backend.log``; with ``durations`` it simulates a device.

See docs/internals/pipeline.md, "afd_mrv2.devices.recording".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

from afd_mrv2.devices.base import BackendCloseReport, Event, Span
from afd_mrv2.errors import PipelineAborted


class Op(NamedTuple):
    """One entry of the op log.

    kind: ``submit`` | ``record`` | ``wait`` | ``sync`` (host waits on an event).
    stream: the stream's name (None for ``sync``).
    event: the event's id (None for ``submit``).
    bound: for ``wait``/``sync``, the log index of the record it waits for (None:
    the event was never recorded, so the wait is a no-op).
    name, item, slots: for ``submit``, the span's phase name, work identity and
    (input slot, output slot).
    """

    kind: str
    stream: str | None
    event: int | None = None
    bound: int | None = None
    name: str | None = None
    item: Any = None
    slots: tuple[int, int] | None = None


class RecordingEvent:
    __slots__ = ("_backend", "event_id", "last_record", "reached_ns")

    def __init__(self, backend: RecordingBackend, event_id: int) -> None:
        self.event_id = event_id
        self._backend = backend
        self.last_record: int | None = None
        self.reached_ns = 0  # simulated device time of the latest record

    def query(self) -> bool:
        # everything ran at submit time; a simulated device reached the event only
        # once the host clock passed it
        return self._backend.durations is None or self.reached_ns <= self._backend.host_ns

    def synchronize(self, timeout: float | None = None) -> bool:
        backend = self._backend
        if backend.aborted:
            raise PipelineAborted("recording backend aborted")
        backend._append(Op("sync", None, self.event_id, self.last_record))
        backend.host_ns = max(backend.host_ns, self.reached_ns)
        return True


class RecordingStream:
    def __init__(self, backend: RecordingBackend, name: str, stream_id: int) -> None:
        self.name = name
        self.stream_id = stream_id
        self._backend = backend
        self.free_ns = 0  # simulated device time at which this stream's queue is empty

    @property
    def native(self) -> None:
        return None

    def submit(self, fn: Callable[[], None], span: Span | None = None) -> None:
        backend = self._backend
        if backend.aborted:
            return
        backend._append(
            Op(
                "submit",
                self.name,
                name=span.name if span else None,
                item=span.item if span else None,
                slots=span.slots if span else None,
            )
        )
        previous, backend.current = backend.current, self
        start = end = 0
        if backend.durations is not None:
            start = max(self.free_ns, backend.host_ns)
            end = self.free_ns = start + backend.durations(span)
        elif span is not None:
            start = backend._tick()
        try:
            fn()
        finally:
            backend.current = previous
            if span is not None:
                span.start_ns = start
                span.end_ns = end if backend.durations is not None else backend._tick()

    def record(self, event: Event) -> None:
        event = _own(event)
        event.last_record = self._backend._append(Op("record", self.name, event.event_id))
        event.reached_ns = self.free_ns

    def wait(self, event: Event) -> None:
        event = _own(event)
        self._backend._append(Op("wait", self.name, event.event_id, event.last_record))
        self.free_ns = max(self.free_ns, event.reached_ns)


class RecordingBackend:
    """See docs/internals/pipeline.md.  ``log`` is the op log the checker reads."""

    name = "recording"

    def __init__(self, durations: Callable[[Span | None], int] | None = None) -> None:
        self.durations = durations
        self.host_ns = 0  # simulated host time (advanced by synchronize)
        self.log: list[Op] = []
        self.aborted = False
        self.current: RecordingStream | None = None
        self._stream_ids = itertools.count(1)
        self._event_ids = itertools.count(1)
        self._clock_ns = 0
        self._names: set[str] = set()
        self._current: dict[str, RecordingStream] = {}

    def _append(self, op: Op) -> int:
        self.log.append(op)
        return len(self.log) - 1

    def _tick(self) -> int:
        self._clock_ns += 1000
        return self._clock_ns

    def new_stream(self, name: str) -> RecordingStream:
        if name in self._names:
            raise ValueError(f"recording backend: stream name {name!r} is already used")
        self._names.add(name)
        return RecordingStream(self, name, next(self._stream_ids))

    def current_stream(self, name: str) -> RecordingStream:
        # The caller's current stream is one stream: asking twice under one name
        # (the executor and the MRV2 ubatch wrapper both do) returns the same object.
        if name not in self._current:
            self._current[name] = self.new_stream(name)
        return self._current[name]

    def new_event(self) -> RecordingEvent:
        return RecordingEvent(self, next(self._event_ids))

    def bind_thread(self, device: Any) -> None:
        del device  # simulated streams: no device to select

    def resolve(self, spans: list[Span]) -> None:
        return None

    def abort(self) -> None:
        self.aborted = True

    def close(self, deadline: float) -> BackendCloseReport:
        del deadline
        return BackendCloseReport()


def _own(event: Event) -> RecordingEvent:
    """``event`` as this backend's event type; an event of another backend is a bug, raised loudly."""
    if not isinstance(event, RecordingEvent):
        raise TypeError(f"{type(event).__name__} is not an event of this backend (expected RecordingEvent)")
    return event
