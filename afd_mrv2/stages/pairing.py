"""Stage identity and dispatch/combine pairing across layers: :func:`check_attention_depth`.

See docs/internals/async-moe-stages.md, "afd_mrv2.stages.pairing".
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from afd_mrv2.errors import ConfigError
from afd_mrv2.items import WorkItem

T = TypeVar("T")


class PairingError(RuntimeError):
    """A combine found no matching dispatch, or transfers piled up past the limit."""


class PendingFifo(Generic[T]):
    """In-flight transfers keyed by (layer, stage), FIFO within one key.

    Pushed by one stream's hook and popped by another's, so it is locked.  ``limit``
    bounds what may be outstanding: a transport that delivers far ahead of the
    schedule is a bug to report, not memory to grow without bound.
    """

    def __init__(self, what: str, *, limit: int) -> None:
        self._what = what
        self._limit = limit
        self._items: dict[WorkItem, deque[T]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def push(self, key: WorkItem, value: T) -> None:
        with self._lock:
            if self._count >= self._limit:
                raise PairingError(
                    f"{self._what}: more than {self._limit} transfers outstanding "
                    f"(pending keys: {', '.join(map(str, sorted(self._items)))}); the schedule and the transport disagree"
                )
            self._items.setdefault(key, deque()).append(value)
            self._count += 1

    def pop(self, key: WorkItem) -> T:
        """The oldest value pushed under ``key``; :class:`PairingError` if there is none."""
        value = self.pop_or_none(key)
        if value is None:
            with self._lock:
                pending = ", ".join(map(str, sorted(self._items))) or "none"
            raise PairingError(f"{self._what}: nothing pending for {key} (pending: {pending})")
        return value

    def pop_or_none(self, key: WorkItem) -> T | None:
        with self._lock:
            queue = self._items.get(key)
            if not queue:
                return None
            value = queue.popleft()
            if not queue:
                del self._items[key]
            self._count -= 1
            return value

    def __len__(self) -> int:
        return self._count

    def keys(self) -> list[WorkItem]:
        with self._lock:
            return sorted(self._items)

    def clear(self) -> int:
        """Drop everything (cleanup after a failure); returns how many were dropped."""
        with self._lock:
            dropped, self._count = self._count, 0
            self._items.clear()
            return dropped


def attention_items(num_layers: int, num_stages: int, *, first_seq: int = 0) -> Iterator[WorkItem]:
    """Attention-side work items: ``(L, s)`` for L in 0..num_layers, layer-major.

    Item ``(L, s)`` receives layer ``L-1``'s combined output (layer 0: the
    embedding), computes layer ``L`` and dispatches it; the extra item
    ``(num_layers, s)`` only receives and finishes the stage.
    """
    seq = first_seq
    for layer in range(num_layers + 1):
        for stage in range(num_stages):
            yield WorkItem(layer, stage, seq, num_stages=num_stages)
            seq += 1


def ffn_items(num_layers: int, num_stages: int, *, sources: int = 1, first_seq: int = 0) -> Iterator[WorkItem]:
    """FFN-side work items: one per (layer, stage) per source attention rank, layer-major."""
    seq = first_seq
    for layer in range(num_layers):
        for stage in range(num_stages):
            for _ in range(sources):
                yield WorkItem(layer, stage, seq, num_stages=num_stages)
                seq += 1


def attention_buffers(num_stages: int) -> tuple[int, int] | None:
    """The (input, output) buffer counts a pipelined attention side may use; None: none do.

    See docs/internals/async-moe-stages.md: ``depth_in + depth_out`` must not exceed the stage
    count, and each count is at least one.
    """
    return (1, 1) if num_stages >= 2 else None


def check_attention_depth(
    buffers: tuple[int, int], num_stages: int, *, pipelined: bool, key: str = "afd.multistream.depth"
) -> None:
    """Refuse attention-side buffer counts whose reuse edges would not order dispatch before combine.

    ``buffers`` is ``multistream.buffer_counts`` (input, output); what matters is
    their sum (see docs/internals/async-moe-stages.md).  ``key`` names the option that set them
    (``afd.multistream.buffers`` when given, else ``afd.multistream.depth``).
    """
    if not pipelined:
        return
    inputs, outputs = buffers
    if inputs + outputs <= num_stages:
        return
    why = (
        f"the recv of attention item (L, s) combines what the send of (L-1, s), {num_stages} item(s) earlier, "
        f"dispatched, and the executor orders a recv only after the send (inputs + outputs) items earlier, so "
        f"inputs + outputs must be at most the number of stages ({num_stages}); got {inputs} + {outputs}"
    )
    if attention_buffers(num_stages) is None:
        fix = "; with one stage no counts do: leave attention out of afd.multistream.roles (serialized)"
    else:
        fix = "; use depth 1 (one input and one output buffer)"
    raise ConfigError(key, why + fix)
