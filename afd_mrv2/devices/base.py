"""The stream/event backend protocol every executor backend implements.

Device-stream semantics (FIFO streams, ``record`` / ``wait`` / ``query`` / ``synchronize``),
kept by every backend, the CPU ones included.

See docs/internals/pipeline.md, "afd_mrv2.devices.base".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from afd_mrv2.items import WorkItem


@dataclass(eq=False)
class Span:
    """One traced phase of one work item on one stream (times in ns)."""

    name: str
    stream_name: str
    stream_id: int
    item: WorkItem | None
    slots: tuple[int, int] | None  # (input slot, output slot) of the work item
    start_ns: int = 0
    end_ns: int = 0
    # Backend-private timing handles (accelerator: the start/end timing events).
    handles: Any = field(default=None, repr=False)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@runtime_checkable
class Event(Protocol):
    def query(self) -> bool:
        """True when the most recent record has completed (or none was issued)."""
        ...

    def synchronize(self, timeout: float | None = None) -> bool:
        """Block the host until the event completes; False if ``timeout`` passed first.

        Raises :class:`~afd_mrv2.errors.PipelineAborted` if the backend was aborted
        while waiting.
        """
        ...


@runtime_checkable
class Stream(Protocol):
    name: str
    stream_id: int

    @property
    def native(self) -> Any:
        """The underlying ``torch.Stream`` on accelerators, else None."""
        ...

    def submit(self, fn: Callable[[], None], span: Span | None = None) -> None: ...

    def record(self, event: Event) -> None: ...

    def wait(self, event: Event) -> None: ...


@dataclass
class BackendCloseReport:
    """What a backend could not stop cleanly within its deadline."""

    # stream name -> description of the work it was still running when abandoned
    abandoned_streams: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.abandoned_streams


@runtime_checkable
class DeviceBackend(Protocol):
    """Factory and owner of streams and events; see docs/internals/pipeline.md."""

    name: str

    def new_stream(self, name: str) -> Stream:
        """A new stream; on accelerators created with ``torch.Stream``."""
        ...

    def current_stream(self, name: str) -> Stream:
        """The stream the caller's work normally runs on (accelerator: the current
        stream); used for compute so model tensors stay on their usual stream."""
        ...

    def new_event(self) -> Event: ...

    def bind_thread(self, device: Any) -> None:
        """Prepare the calling host thread (a new one, e.g. a micro-batch thread) to issue work on
        ``device`` (a ``torch.device``): the accelerator backend selects it, the CPU backends need nothing.
        The one place a thread's device is chosen (upstream's ``torch.accelerator.set_device_index``
        of a CPU device's index None raises)."""
        ...

    def resolve(self, spans: list[Span]) -> None:
        """Fill device-measured span times; call only once the spans' work completed."""
        ...

    def abort(self) -> None:
        """Stop executing queued work and wake every waiter with PipelineAborted."""
        ...

    def close(self, deadline: float) -> BackendCloseReport:
        """Finish or abandon all streams by ``deadline`` (a ``time.monotonic()`` value)."""
        ...
