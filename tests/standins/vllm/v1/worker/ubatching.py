"""Stand-in for vllm.v1.worker.ubatching: microbatch threads that hand off at dbo_yield.

Simplified: each context owns a threading.Event; entering waits for it, yielding
and exiting set the next context's event.  Only one microbatch thread runs at a time.
"""

from __future__ import annotations

import threading

_CONTEXT_OF_THREAD: dict[int, UBatchContext] = {}


class UBatchContext:
    def __init__(
        self, id, comm_stream, compute_stream, forward_context, ready_barrier, cpu_wait_event, cpu_signal_event
    ):
        self.id = id
        self.comm_stream = comm_stream
        self.compute_stream = compute_stream
        self.forward_context = forward_context
        self.ready_barrier = ready_barrier
        self.cpu_wait_event = cpu_wait_event
        self.cpu_signal_event = cpu_signal_event

    def __enter__(self):
        _CONTEXT_OF_THREAD[threading.get_ident()] = self
        self.ready_barrier.wait()
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()
        return self

    def __exit__(self, *exc):
        del _CONTEXT_OF_THREAD[threading.get_ident()]
        self.cpu_signal_event.set()
        return False

    def yield_(self):
        self.cpu_signal_event.set()
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()


def make_ubatch_contexts(
    num_micro_batches,
    compute_stream,
    comm_stream,
    forward_contexts,
    ready_barrier,
    schedule="default",
    token_offsets=None,
):
    events = [threading.Event() for _ in range(num_micro_batches)]
    return [
        UBatchContext(
            i,
            comm_stream,
            compute_stream,
            forward_contexts[i],
            ready_barrier,
            events[i],
            events[(i + 1) % num_micro_batches],
        )
        for i in range(num_micro_batches)
    ]


def dbo_enabled() -> bool:
    return bool(_CONTEXT_OF_THREAD)


def dbo_current_ubatch_id() -> int:
    context = _CONTEXT_OF_THREAD.get(threading.get_ident())
    return 0 if context is None else context.id


def dbo_yield() -> None:
    context = _CONTEXT_OF_THREAD.get(threading.get_ident())
    if context is not None:
        context.yield_()
