"""Host backend: each stream is a worker thread, so overlap on CPUs is real.

See docs/internals/pipeline.md, "afd_mrv2.devices.host".
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from afd_mrv2.devices.base import BackendCloseReport, Event, Span
from afd_mrv2.errors import PipelineAborted

_RUN, _RECORD, _WAIT, _STOP = 0, 1, 2, 3
_ids = itertools.count(1)


class HostEvent:
    """An event with generation counting: records and waits pair like on CUDA."""

    __slots__ = ("_backend", "_completed", "_cond", "_recorded")

    def __init__(self, backend: HostBackend) -> None:
        self._backend = backend
        self._cond = threading.Condition(threading.Lock())
        self._recorded = 0  # generation of the most recent record() call
        self._completed = 0  # highest generation a stream has reached

    def _issue(self) -> int:
        with self._cond:
            self._recorded += 1
            return self._recorded

    def _complete(self, generation: int) -> None:
        with self._cond:
            if generation > self._completed:
                self._completed = generation
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait_for(self, generation: int, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._completed < generation:
                if self._backend.aborted:
                    raise PipelineAborted("host backend aborted while waiting on an event")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def query(self) -> bool:
        with self._cond:
            return self._completed >= self._recorded

    def synchronize(self, timeout: float | None = None) -> bool:
        with self._cond:
            target = self._recorded
        return self._wait_for(target, timeout)


class HostStream:
    """A FIFO of work run by one daemon thread."""

    def __init__(self, backend: HostBackend, name: str) -> None:
        self.name = name
        self.stream_id = next(_ids)
        self._backend = backend
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.running: str | None = None  # what the thread is doing right now, for reports
        self._thread = threading.Thread(target=self._loop, name=f"afd-stream-{name}", daemon=True)
        self._thread.start()

    @property
    def native(self) -> None:
        return None

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, fn: Callable[[], None], span: Span | None = None) -> None:
        self._queue.put((_RUN, fn, span))

    def record(self, event: Event) -> None:
        event = _own(event)
        self._queue.put((_RECORD, event, event._issue()))

    def wait(self, event: Event) -> None:
        event = _own(event)
        with event._cond:
            target = event._recorded
        if target:
            self._queue.put((_WAIT, event, target))

    def _stop(self) -> None:
        self._queue.put((_STOP, None, None))

    def _loop(self) -> None:
        _local.stream = self
        backend = self._backend
        get = self._queue.get
        while True:
            kind, obj, arg = get()
            if kind == _STOP:
                return
            if backend.aborted:
                continue  # drain the queue without running anything
            if kind == _RECORD:
                obj._complete(arg)
            elif kind == _WAIT:
                self.running = "waiting on an event"
                with contextlib.suppress(PipelineAborted):
                    obj._wait_for(arg, None)
            else:
                self._run(obj, arg)
            self.running = None

    def _run(self, fn: Callable[[], None], span: Span | None) -> None:
        if span is not None:
            self.running = f"{span.name} of {span.item}" if span.item is not None else span.name
            span.start_ns = time.perf_counter_ns()
        else:
            self.running = "submitted work"
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - a stream thread must never die silently
            self._backend._stream_failed(self, exc)
        if span is not None:
            span.end_ns = time.perf_counter_ns()


_local = threading.local()


def current_host_stream() -> HostStream | None:
    """The host stream whose thread is calling, or None on any other thread."""
    return getattr(_local, "stream", None)


class HostBackend:
    """Streams as threads; see docs/internals/pipeline.md."""

    name = "host"

    def __init__(self) -> None:
        self.aborted = False
        self.errors: list[tuple[str, BaseException]] = []
        self._streams: list[HostStream] = []
        self._events: list[HostEvent] = []
        self._closed = False

    def new_stream(self, name: str) -> HostStream:
        if self._closed:
            raise RuntimeError("host backend is closed")
        stream = HostStream(self, name)
        self._streams.append(stream)
        return stream

    def current_stream(self, name: str) -> HostStream:
        # A CPU has no "current stream"; compute gets a worker thread of its own.
        return self.new_stream(name)

    def new_event(self) -> HostEvent:
        event = HostEvent(self)
        self._events.append(event)
        return event

    def bind_thread(self, device: Any) -> None:
        del device  # a CPU thread needs no device selection

    def resolve(self, spans: list[Span]) -> None:
        return None  # host spans are timed in place by the stream threads

    def _stream_failed(self, stream: HostStream, exc: BaseException) -> None:
        self.errors.append((stream.name, exc))
        self.abort()

    def abort(self) -> None:
        self.aborted = True
        for event in self._events:
            event._wake()

    def threads(self) -> list[threading.Thread]:
        return [s.thread for s in self._streams]

    def close(self, deadline: float) -> BackendCloseReport:
        """Let each stream finish its queue, then stop; abandon what outlives ``deadline``."""
        if not self._closed:
            self._closed = True
            for stream in self._streams:
                stream._stop()
        for stream in self._streams:
            stream.thread.join(max(0.0, deadline - time.monotonic()))
        if any(s.thread.is_alive() for s in self._streams):
            self.abort()
            grace = time.monotonic() + 0.1
            for stream in self._streams:
                stream.thread.join(max(0.0, grace - time.monotonic()))
        report = BackendCloseReport()
        for stream in self._streams:
            if stream.thread.is_alive():
                report.abandoned_streams[stream.name] = stream.running or "unknown work"
        return report


def _own(event: Event) -> HostEvent:
    """``event`` as this backend's event type; an event of another backend is a bug, raised loudly."""
    if not isinstance(event, HostEvent):
        raise TypeError(f"{type(event).__name__} is not an event of this backend (expected HostEvent)")
    return event
