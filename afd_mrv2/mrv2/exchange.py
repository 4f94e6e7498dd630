"""Per-microbatch AFD transfers, run as work items of the shared executor.

On the Attention side a model layer hands its hidden states to
:meth:`UBatchExchange.exchange` at each AFD point; the exchange turns the call into
one :class:`~afd_mrv2.work.WorkItem` ``(layer, microbatch, seq)`` and runs it
through the executor, whose connector hooks (``on_recv`` -> ``on_compute`` ->
``on_send``) do the transfer on the executor's streams.  The connector reaches the
data through two resources (the contract ``simlink`` documents):

* ``source(item) -> Tensor``: the hidden states handed to ``exchange`` for ``item``;
* ``sink(item, Tensor)``: where the connector delivers the item's result.

The microbatch id comes from upstream's ``dbo_current_ubatch_id`` (through the
typed adapter).  Microbatch threads hand off to each other, so only one is inside
``exchange`` at a time; a lock makes that explicit.  ``exchange`` waits on the
host for its own item (an event wait per item, never a device-wide synchronize):
the model needs the result before its next layer.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from afd_mrv2.items import WorkItem


class UBatchExchange:
    def __init__(self, current_ubatch_id: Callable[[], int]) -> None:
        self._current_ubatch_id = current_ubatch_id
        self._inputs: dict[WorkItem, Any] = {}
        self._outputs: dict[WorkItem, Any] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._executor: Any = None
        self.items: list[WorkItem] = []  # every item exchanged, in order (for tests and traces)

    def resources(self) -> dict[str, Any]:
        return {"source": self._inputs.__getitem__, "sink": self._outputs.__setitem__}

    def bind(self, executor: Any) -> None:
        self._executor = executor

    def exchange(self, layer_idx: int, hidden_states: Any) -> Any:
        """Run the AFD transfer of ``hidden_states`` for this layer and microbatch; return the result."""
        if self._executor is None:
            raise RuntimeError("UBatchExchange.exchange called before bind(executor)")
        with self._lock:
            item = WorkItem(layer_idx, self._current_ubatch_id(), next(self._seq))
            self.items.append(item)
            self._inputs[item] = hidden_states
            try:
                self._executor.submit(item)
                self._executor.drain()
            finally:
                self._inputs.pop(item, None)
            return self._outputs.pop(item)
