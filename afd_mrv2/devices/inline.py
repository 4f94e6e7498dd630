"""Inline backend: every stream runs its work at once, on the thread that submits it.

The device-stream contract holds trivially: a stream runs its work in submission
order because ``submit`` runs it before returning; ``record`` completes the event at
once (everything submitted before it already ran); ``wait`` has nothing to wait for.
This is where the host work of an accelerator stream runs too (``fn`` enqueues
kernels on the caller's thread); here ``fn`` is the work itself.

Who uses it: a *serialized* executor whose caller is the model's own thread, i.e. the
Attention side of a vLLM MoE layer on CPU (:mod:`afd_mrv2.mrv2.attention.remote`).  On the host
backend its one stream is a thread of its own, so every item costs two thread
hand-offs, and in a micro-batched step the stream thread competes for the engine's
core and for the GIL with the sibling micro-batch that is computing meanwhile: the
dispatch then leaves late and the round trip grows by the scheduler's and the GIL's
switch intervals.  Inline, ``start`` has put the dispatch on the wire when it
returns, before the hand-off to the sibling.

A phase that raises aborts the backend as on the host backend: the error is kept in
``errors``, later work is skipped, and events recorded after the failure never
complete (a host wait on one raises :class:`~afd_mrv2.errors.PipelineAborted`).
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
    """Streams that run on the caller's thread; see the module docstring."""

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
