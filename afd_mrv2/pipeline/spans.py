"""Span collection: one span per phase of every item, resolved once the item completed.

The executor opens a span when it issues a phase and releases an item's spans
when the item's send completed; only then are device-measured times valid, so
release is where the backend resolves them.  Resolved spans go to the sinks: the
trace (every span) and the depth tuner (while it is still measuring).  With no
sink the collector keeps nothing.
"""

from __future__ import annotations

from afd_mrv2.devices.base import DeviceBackend, Span, Stream
from afd_mrv2.pipeline.autodepth import DepthTuner
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.work import Work


class SpanCollector:
    """Opens, resolves and hands out the executor's phase spans."""

    def __init__(self, backend: DeviceBackend, *, trace: Trace | None = None, tuner: DepthTuner | None = None) -> None:
        self.backend = backend
        self.trace = trace
        self.tuner = tuner
        self._pending: dict[int, list[Span]] = {}  # item seq -> spans awaiting resolve

    @property
    def active(self) -> bool:
        """True while some sink wants spans."""
        return self.trace is not None or (self.tuner is not None and self.tuner.measuring)

    def open(self, phase: str, stream: Stream, work: Work) -> Span:
        """The span the backend fills for ``phase`` of ``work`` (kept only when a sink listens;
        the backend also uses it to name the work it abandons at close)."""
        span = Span(phase, stream.name, stream.stream_id, work.item, (work.inputs.index, work.outputs.index))
        if self.active:
            if self.trace is not None:
                self.trace.add(span)
            self._pending.setdefault(work.item.seq, []).append(span)
        return span

    def release(self, seq: int) -> None:
        """Resolve the spans of item ``seq`` (its work completed) and feed the tuner."""
        spans = self._pending.pop(seq, None)
        if not spans:
            return
        self.backend.resolve(spans)
        if self.tuner is not None and self.tuner.measuring:
            self.tuner.observe(spans)
