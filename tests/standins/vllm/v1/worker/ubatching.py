"""Stand-in for vllm.v1.worker.ubatching: micro-batch threads that hand off at dbo_yield.

Our own reduced code with upstream's contract (vLLM 0.32/0.33, read in the wheels):
two ``threading.Event`` s per micro-batch, one thread runs at a time; ``__enter__``
registers the thread in the process-wide registry, waits at the ready barrier and
then for its own event; ``__exit__`` unregisters it and sets the next micro-batch's
event; ``dbo_yield`` sets the next micro-batch's event and parks on its own (no
timeout: a sibling that never signals back parks the thread forever, as upstream);
``dbo_enabled`` is process-wide (True while any micro-batch thread is registered);
``dbo_current_ubatch_id`` raises KeyError in an unregistered thread while another
is registered.  Streams are never switched here (on CPU upstream's switches are
no-ops under vLLM's placeholders).
"""

from __future__ import annotations

import threading

_THREAD_ID_TO_CONTEXT: dict[int, int] = {}
_CURRENT_CONTEXTS: list[UBatchContext | None] = []


class UBatchContext:
    def __init__(
        self,
        id,
        comm_stream,
        compute_stream,
        forward_context,
        ready_barrier,
        cpu_wait_event,
        cpu_signal_event,
        gpu_comm_done_event=None,
        gpu_compute_done_event=None,
        schedule="default",
    ):
        self.id = id
        self.comm_stream = comm_stream
        self.compute_stream = compute_stream
        self.forward_context = forward_context
        self.ready_barrier = ready_barrier
        self.cpu_wait_event = cpu_wait_event
        self.cpu_signal_event = cpu_signal_event
        self.current_stream = compute_stream

    def __enter__(self):
        _THREAD_ID_TO_CONTEXT[threading.get_ident()] = self.id
        _CURRENT_CONTEXTS[self.id] = self
        self.ready_barrier.wait()
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()
        self._restore_context()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        _CURRENT_CONTEXTS[self.id] = None
        del _THREAD_ID_TO_CONTEXT[threading.get_ident()]
        self.cpu_signal_event.set()
        self.cpu_wait_event.clear()
        return False

    def _restore_context(self):
        from ... import forward_context

        forward_context._forward_context = self.forward_context

    def yield_(self):
        assert not self.cpu_wait_event.is_set()
        self.cpu_signal_event.set()
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()
        self._restore_context()


def make_ubatch_contexts(
    num_micro_batches,
    compute_stream,
    comm_stream,
    forward_contexts,
    ready_barrier,
    schedule="default",
    token_offsets=None,
):
    assert num_micro_batches > 1, "num_micro_batches must be greater than 1"
    if len(_CURRENT_CONTEXTS) < num_micro_batches:
        _CURRENT_CONTEXTS.extend([None] * (num_micro_batches - len(_CURRENT_CONTEXTS)))
    events = [threading.Event() for _ in range(num_micro_batches)]
    return [
        UBatchContext(
            id=i,
            comm_stream=comm_stream,
            compute_stream=compute_stream,
            forward_context=forward_contexts[i],
            ready_barrier=ready_barrier,
            cpu_wait_event=events[i],
            cpu_signal_event=events[(i + 1) % num_micro_batches],
        )
        for i in range(num_micro_batches)
    ]


def dbo_enabled() -> bool:
    return len(_THREAD_ID_TO_CONTEXT) > 0


def dbo_current_ubatch_id() -> int:
    if len(_THREAD_ID_TO_CONTEXT) == 0:
        return 0
    return _THREAD_ID_TO_CONTEXT[threading.get_ident()]


def dbo_yield() -> None:
    """Hand the core to the next micro-batch (a no-op outside a split step)."""
    if _THREAD_ID_TO_CONTEXT:
        context = _CURRENT_CONTEXTS[_THREAD_ID_TO_CONTEXT[threading.get_ident()]]
        assert context is not None
        context.yield_()
