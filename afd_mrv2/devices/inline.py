"""Inline backend: every stream runs its work at once, on the thread that submits it.

Used by a serialized executor driven from the model's own thread (the Attention side on CPU).

See docs/internals/pipeline.md, "afd_mrv2.devices.inline".
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from afd_mrv2.devices.base import BackendCloseReport, Event, Span
from afd_mrv2.errors import PipelineAborted

_ids = itertools.count(1)


class InlineEvent:
    """Complete once recorded (before any failure of its backend)."""

    __slots__ = ("_backend", "_completed", "_recorded")

    def __init__(self, backend: InlineBackend) -> None:
        self._backend = backend
        self._recorded = 0
        self._completed = 0

    def query(self) -> bool:
        return self._completed >= self._recorded

    def synchronize(self, timeout: float | None = None) -> bool:
        del timeout  # nothing is ever pending: an event is complete at once or never
        if self._completed < self._recorded:
            raise PipelineAborted("inline backend aborted before this event was reached")
        return True


class InlineStream:
    """Runs each submitted function at once on the caller's thread."""

    def __init__(self, backend: InlineBackend, name: str) -> None:
        self.name = name
        self.stream_id = next(_ids)
        self._backend = backend

    @property
    def native(self) -> None:
        return None

    def submit(self, fn: Callable[[], None], span: Span | None = None) -> None:
        backend = self._backend
        if backend.aborted:
            return
        if span is not None:
            span.start_ns = time.perf_counter_ns()
        import torch  # here, not at import: the devices package stays importable without torch loaded

        try:
            with torch.inference_mode(False):  # as on a stream thread, whatever the caller's mode
                fn()
        except BaseException as exc:  # noqa: BLE001 - kept, like a stream thread's failure
            backend._stream_failed(self, exc)
        if span is not None:
            span.end_ns = time.perf_counter_ns()

    def record(self, event: Event) -> None:
        event = _own(event)
        event._recorded += 1
        if not self._backend.aborted:
            event._completed = event._recorded

    def wait(self, event: Event) -> None:
        _own(event)  # everything recorded before ran already


class InlineBackend:
    """Streams that run on the caller's thread; see docs/internals/pipeline.md."""

    name = "inline"

    def __init__(self) -> None:
        self.aborted = False
        self.errors: list[tuple[str, BaseException]] = []
        self._closed = False

    def new_stream(self, name: str) -> InlineStream:
        if self._closed:
            raise RuntimeError("inline backend is closed")
        return InlineStream(self, name)

    def current_stream(self, name: str) -> InlineStream:
        return self.new_stream(name)

    def new_event(self) -> InlineEvent:
        return InlineEvent(self)

    def bind_thread(self, device: Any) -> None:
        del device  # a CPU thread needs no device selection

    def resolve(self, spans: list[Span]) -> None:
        return None  # timed in place by ``submit``

    def _stream_failed(self, stream: InlineStream, exc: BaseException) -> None:
        self.errors.append((stream.name, exc))
        self.abort()

    def abort(self) -> None:
        self.aborted = True

    def threads(self) -> list[threading.Thread]:
        return []

    def close(self, deadline: float) -> BackendCloseReport:
        del deadline  # nothing runs outside a caller's own call
        self._closed = True
        return BackendCloseReport()


def _own(event: Event) -> InlineEvent:
    if not isinstance(event, InlineEvent):
        raise TypeError(f"{type(event).__name__} is not an event of this backend (expected InlineEvent)")
    return event
