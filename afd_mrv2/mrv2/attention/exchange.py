"""Per-microbatch AFD transfers, run as work items of the shared executor.

:class:`UBatchExchange` (``start`` / ``finish`` / ``exchange``, ``source`` / ``sink``).

See docs/internals/micro-batching.md, "afd_mrv2.mrv2.attention.exchange".
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from afd_mrv2.api import InFlight, InFlightSink
from afd_mrv2.errors import PipelineError
from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline.executor import Executor

_NO_RESULT = object()
_HISTORY = 4096  # items kept in ``UBatchExchange.items``


@dataclass(frozen=True)
class Ticket:
    """What ``start`` returns and ``finish`` takes: the item in flight, and when it was started
    (``time.perf_counter_ns``)."""

    item: WorkItem
    started_ns: int = 0


@dataclass(eq=False)
class _Entry:
    """One pool entry: an item's hidden states and, once delivered, its result and when."""

    hidden: object  # the payload ``start`` took, handed to the connector unread
    result: Any = _NO_RESULT  # the connector's result (the hook API's ``sink`` takes Any)
    delivered_ns: int = 0

    def deliver(self, result: object) -> None:
        self.result = result
        self.delivered_ns = time.perf_counter_ns()


class _Sink(InFlightSink):
    """The ``sink``: ``finish`` waits for an :class:`InFlight` result, so it declares it takes one."""

    def __init__(self, deliver: Callable[[WorkItem, object], None]) -> None:
        self._deliver = deliver

    def __call__(self, item: WorkItem, result: object) -> None:
        self._deliver(item, result)


class UBatchExchange:
    """The Attention side's AFD transfers; see docs/internals/micro-batching.md."""

    def __init__(self) -> None:
        self._entries: dict[WorkItem, _Entry] = {}  # started, not finished (at most ``capacity``)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self.capacity = 0  # pool entries, set by bind()
        # the most recent items started, in order (for tests and traces; bounded: a server runs for days)
        self.items: deque[WorkItem] = deque(maxlen=_HISTORY)
        #: the connector's ``sink`` (a context field): where it delivers each item's result
        self.sink: InFlightSink = _Sink(self._deliver)

    def source(self, item: WorkItem) -> object:
        """The connector's ``source`` (a context field): the hidden states handed to ``start`` for ``item``."""
        return self._entries[item].hidden

    def resources(self) -> dict[str, object]:
        """``source`` and ``sink`` by name (hook API 1's ``resources`` form)."""
        return {"source": self.source, "sink": self.sink}

    def bind(self, executor: Executor) -> None:
        """Run transfers on ``executor``; sizes the pool from its buffer counts."""
        inputs, outputs = executor.config.buffer_counts
        self._executor = executor
        self.capacity = inputs + outputs

    @property
    def in_flight(self) -> list[WorkItem]:
        """Items started and not yet finished, in start order."""
        return list(self._entries)

    # ------------------------------------------------------------------ the connector's delivery

    def _deliver(self, item: WorkItem, result: object) -> None:
        entry = self._entries.get(item)
        if entry is not None:  # None only after finish gave up on a failed pipeline
            entry.deliver(result)

    # ------------------------------------------------------------------ the model's calls

    def start(self, layer_idx: int, hidden_states: object, *, stage: tuple[int, int] = (0, 1)) -> Ticket:
        """Enqueue the AFD transfer of ``hidden_states`` for this layer and ``stage`` ``(i, n)``: stage i of n."""
        executor = self._require_executor()
        with self._lock:
            if len(self._entries) >= self.capacity:
                open_items = ", ".join(str(i) for i in self._entries)
                raise RuntimeError(
                    f"UBatchExchange.start: {len(self._entries)} transfers already started and not finished "
                    f"(the pool holds depth_in + depth_out = {self.capacity}): {open_items}; "
                    "finish a transfer before starting another"
                )
            item = WorkItem(layer_idx, stage[0], next(self._seq), num_stages=stage[1])
            started = time.perf_counter_ns()
            self._entries[item] = _Entry(hidden_states)
            self.items.append(item)
            try:
                executor.submit(item)
            except BaseException:
                del self._entries[item]
                raise
        return Ticket(item, started)

    def finish(self, ticket: Ticket) -> Any:
        """Wait for ``ticket``'s item only and return its result."""
        return self.finish_timed(ticket)[0]

    def finish_timed(self, ticket: Ticket) -> tuple[Any, int]:
        """:meth:`finish`, also returning when the connector delivered the result (``perf_counter_ns``)."""
        executor = self._require_executor()
        item = ticket.item
        if item not in self._entries:
            raise RuntimeError(f"UBatchExchange.finish: {item} is not in flight (finished twice, or never started)")
        try:
            executor.wait_for(item.seq)
        finally:
            entry = self._entries.pop(item)
        if entry.result is _NO_RESULT:
            raise RuntimeError(f"UBatchExchange.finish: the connector completed {item} without calling sink")
        if isinstance(entry.result, InFlight):
            try:
                value = entry.result.wait()
            except Exception as exc:
                first = (str(exc).splitlines() or [""])[0]
                raise PipelineError(
                    f"receiving the result of {item} failed: {type(exc).__name__}: {first}", item=item, phase="recv"
                ) from exc
            return value, entry.result.delivered_ns
        return entry.result, entry.delivered_ns

    def exchange(self, layer_idx: int, hidden_states: object, *, stage: tuple[int, int] = (0, 1)) -> Any:
        """``start`` + ``finish``: the transfer for callers that do not overlap."""
        return self.finish(self.start(layer_idx, hidden_states, stage=stage))

    def _require_executor(self) -> Executor:
        if self._executor is None:
            raise RuntimeError("UBatchExchange used before bind(executor)")
        return self._executor
