"""Accelerator backend: ``torch.Stream`` / ``torch.Event`` on whatever device
``torch.accelerator`` reports (CUDA; Ascend NPU through PrivateUse1; any other).

See docs/internals/pipeline.md, "afd_mrv2.devices.accelerator".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from afd_mrv2.devices.base import BackendCloseReport, Event, Span
from afd_mrv2.errors import PipelineAborted


def accelerator_available() -> bool:
    return torch.accelerator.is_available()


def _poll(done: Callable[[], bool], backend: AcceleratorBackend, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.0
    while not done():
        if backend.aborted:
            raise PipelineAborted("accelerator backend aborted while waiting on an event")
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(1e-3, delay * 2 + 2e-5)
    return True


class AcceleratorEvent:
    __slots__ = ("_backend", "native")

    def __init__(self, backend: AcceleratorBackend, native: torch.Event) -> None:
        self.native = native
        self._backend = backend

    def query(self) -> bool:
        return self.native.query()

    def synchronize(self, timeout: float | None = None) -> bool:
        return _poll(self.native.query, self._backend, timeout)


class AcceleratorStream:
    def __init__(self, backend: AcceleratorBackend, name: str, native: torch.Stream) -> None:
        self.name = name
        self.stream_id = int(native.stream_id)
        self._backend = backend
        self._native = native

    @property
    def native(self) -> torch.Stream:
        return self._native

    def submit(self, fn: Callable[[], None], span: Span | None = None) -> None:
        backend = self._backend
        if backend.aborted:
            return
        with self._native:
            if span is not None and backend.timing:
                start, end = backend._timing_event(), backend._timing_event()
                start.record(self._native)
                fn()
                end.record(self._native)
                span.handles = (start, end)
            else:
                fn()

    def record(self, event: Event) -> None:
        event = _own(event)
        event.native.record(self._native)

    def wait(self, event: Event) -> None:
        event = _own(event)
        event.native.wait(self._native)

    def query(self) -> bool:
        return self._native.query()


class AcceleratorBackend:
    """See docs/internals/pipeline.md.  ``timing=True`` records span timing events."""

    name = "accelerator"

    def __init__(self, *, timing: bool = True) -> None:
        if not torch.accelerator.is_available():
            raise RuntimeError(
                "the accelerator backend needs a device torch.accelerator reports "
                "(CUDA, or NPU with torch_npu imported); none is available: use backend 'host'"
            )
        self.device = torch.accelerator.current_accelerator()
        self.timing = timing
        self.aborted = False
        self._streams: list[AcceleratorStream] = []
        self._free_timing: list[torch.Event] = []
        self._base = torch.Event(device=self.device, enable_timing=True)
        self._base.record(torch.accelerator.current_stream())
        self._base.synchronize()
        self._base_ns = time.perf_counter_ns()

    def new_stream(self, name: str) -> AcceleratorStream:
        stream = AcceleratorStream(self, name, torch.Stream(device=self.device))
        self._streams.append(stream)
        return stream

    def current_stream(self, name: str) -> AcceleratorStream:
        stream = AcceleratorStream(self, name, torch.accelerator.current_stream())
        self._streams.append(stream)
        return stream

    def new_event(self) -> AcceleratorEvent:
        return AcceleratorEvent(self, torch.Event(device=self.device))

    def bind_thread(self, device: torch.device | None) -> None:
        chosen = self.device if device is None or device.index is None else device
        index = None if chosen is None else chosen.index
        if index is not None:
            torch.accelerator.set_device_index(index)

    def _timing_event(self) -> torch.Event:
        if self._free_timing:
            return self._free_timing.pop()
        return torch.Event(device=self.device, enable_timing=True)

    def resolve(self, spans: list[Span]) -> None:
        for span in spans:
            if span.handles is None:
                continue
            start, end = span.handles
            span.start_ns = self._base_ns + int(self._base.elapsed_time(start) * 1e6)
            span.end_ns = self._base_ns + int(self._base.elapsed_time(end) * 1e6)
            span.handles = None
            self._free_timing += (start, end)

    def abort(self) -> None:
        self.aborted = True

    def close(self, deadline: float) -> BackendCloseReport:
        report = BackendCloseReport()
        for stream in self._streams:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                finished = _poll(stream.query, self, remaining)
            except PipelineAborted:
                finished = stream.query()
            if not finished:
                report.abandoned_streams[stream.name] = "device work still pending at the deadline"
        return report


def _own(event: Event) -> AcceleratorEvent:
    """``event`` as this backend's event type; an event of another backend is a bug, raised loudly."""
    if not isinstance(event, AcceleratorEvent):
        raise TypeError(f"{type(event).__name__} is not an event of this backend (expected AcceleratorEvent)")
    return event
