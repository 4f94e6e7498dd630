"""Per-microbatch AFD transfers, run as work items of the shared executor.

On the Attention side a model layer hands its hidden states to the exchange at
each AFD point; the exchange turns the call into one
:class:`~afd_mrv2.items.WorkItem` ``(layer, microbatch, seq)`` and runs it through
the executor, whose connector hooks (``on_recv`` -> ``on_compute`` -> ``on_send``)
do the transfer on the executor's streams.  The connector reaches the data through
two fields of its context (the contract ``simlink`` documents), :attr:`UBatchExchange.source`
and :attr:`UBatchExchange.sink`:

* ``source(item) -> Tensor``: the hidden states handed to ``start`` for ``item``;
* ``sink(item, result)``: where the connector delivers the item's result: the
  tensor, or a result still in flight (:class:`InFlight`: ``wait()`` returns it,
  ``delivered_ns`` says when it arrived), which ``finish`` waits for on the caller's
  thread.  A connector whose receive completes after its ``on_send`` (torch_p2p's
  round-trip side) hands the latter, so its send stream is free for the next item
  while this one's result is on its way; it does so only to a sink that declares
  it takes one (:class:`~afd_mrv2.api.InFlightSink`: this exchange's does), so a
  third-party connector that wraps the sink keeps receiving tensors.

Each item carries its stage identity, ``stage i of n`` (``WorkItem.stage_idx`` and
``num_stages``), given by the caller of ``start``: the micro-batch index and the
step's micro-batch count in a split step, ``0 of 1`` in an unsplit one.  The
connector puts it on the wire beside the layer; the FFN side follows it
(``follow_stages`` of torch_p2p), so an engine may split some steps and not others.

Start and finish
----------------
A transfer is split the way vLLM's dual-batch overlap splits an all-to-all
(dispatch, yield, combine)::

    ticket = exchange.start(layer, hidden, stage=(i, n))  # dispatch: enqueue send + receive
    dbo_yield()                                           # the sibling microbatch computes meanwhile
    hidden = exchange.finish(ticket)                      # combine: wait for THIS item's result

``start`` submits the item (the executor enqueues its recv, compute and send on
its streams) and returns; nothing it took is held afterwards, so while the
transfer is in flight the other microbatch runs freely.  ``finish`` waits for this
item only (:meth:`Executor.wait_for`: a host wait on the item's ``done`` event,
never a drain of other items, never a device-wide synchronize; then, for a result
still in flight, its ``wait()``) and returns the result the connector delivered to
``sink``.  :meth:`UBatchExchange.exchange` is
``start`` + ``finish`` for callers that do not overlap.  The host wait in
``finish`` is the one documented host wait of the Attention side: the model reads
the result on the host's schedule; an accelerator build could make the compute
stream wait on the ``done`` event instead.

Threads
-------
``Executor.submit`` and ``wait_for`` are driven from one thread at a time.  vLLM's
microbatch threads hand off to each other (``UBatchContext``: a thread runs only
after the other signalled its event and parks until signalled back), so exactly
one is between two hand-offs, and the event set/wait orders one thread's calls
before the next thread's.  The executor therefore sees its calls serialized by
the hand-off, and submits stay in increasing ``seq`` order.  The lock below
covers only the submit bookkeeping (seq, pool entry, ``submit``), never the
in-flight window, so it could not block the sibling even if the threads did not
hand off.  The connector's ``source`` and ``sink`` run on stream threads; they
touch only the pool entry of their own item.

Transfer-state pool
-------------------
Each started, unfinished item holds one pool entry (its hidden states, read by
``source`` until ``on_recv`` ran, and its result, written by ``sink``).  The
executor bounds the items in flight to ``depth_in + depth_out`` (its input slots
gate new items on compute, its output slots gate compute on send), so the pool
holds ``inputs + outputs`` entries of the executor's allocated buffer counts
(``MultistreamConfig.buffer_counts``, the most ``depth: auto`` may choose).
With vLLM's pattern each microbatch has at most one item open, so two microbatches
need two entries and depth 1 already fits.  A ``start`` beyond the pool raises:
a microbatch that starts more transfers than that without finishing them is a bug.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
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

    hidden: Any
    result: Any = _NO_RESULT
    delivered_ns: int = 0

    def deliver(self, result: Any) -> None:
        self.result = result
        self.delivered_ns = time.perf_counter_ns()


class _Sink(InFlightSink):
    """The ``sink``: ``finish`` waits for an :class:`InFlight` result, so it declares it takes one."""

    def __init__(self, deliver: Any) -> None:
        self._deliver = deliver

    def __call__(self, item: WorkItem, result: Any) -> None:
        self._deliver(item, result)


class UBatchExchange:
    """The Attention side's AFD transfers; see the module docstring."""

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

    def source(self, item: WorkItem) -> Any:
        """The connector's ``source`` (a context field): the hidden states handed to ``start`` for ``item``."""
        return self._entries[item].hidden

    def resources(self) -> dict[str, Any]:
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

    def _deliver(self, item: WorkItem, result: Any) -> None:
        entry = self._entries.get(item)
        if entry is not None:  # None only after finish gave up on a failed pipeline
            entry.deliver(result)

    # ------------------------------------------------------------------ the model's calls

    def start(self, layer_idx: int, hidden_states: Any, *, stage: tuple[int, int] = (0, 1)) -> Ticket:
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

    def exchange(self, layer_idx: int, hidden_states: Any, *, stage: tuple[int, int] = (0, 1)) -> Any:
        """``start`` + ``finish``: the transfer for callers that do not overlap."""
        return self.finish(self.start(layer_idx, hidden_states, stage=stage))

    def _require_executor(self) -> Executor:
        if self._executor is None:
            raise RuntimeError("UBatchExchange used before bind(executor)")
        return self._executor
