"""The hand-off between micro-batch threads at an AFD exchange, and a split step's abort flag.

:class:`Handoff`, :class:`SplitStep`, :class:`SiblingFailed`, :class:`MicroBatchFailed`.

See docs/internals/micro-batching.md, "afd_mrv2.mrv2.attention.handoff".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from afd_mrv2.errors import PipelineError


class MicroBatchFailed(PipelineError):
    """A micro-batch of a split engine step failed; the message names it and the cause."""

    def __init__(self, ubatch: int, num_ubatches: int, cause: BaseException) -> None:
        first = (str(cause).splitlines() or [""])[0]
        super().__init__(f"micro-batch {ubatch} of {num_ubatches} failed: {type(cause).__name__}: {first}")
        self.ubatch = ubatch
        self.num_ubatches = num_ubatches
        self.cause = cause


class SiblingFailed(PipelineError):
    """Raised in a micro-batch thread whose sibling failed (the thread ends instead of waiting forever)."""


@dataclass(frozen=True)
class Handoff:
    """vLLM's micro-batch hand-off functions (``vllm.v1.worker.ubatching``), as afd-mrv2 uses them.

    ``active``: ``dbo_enabled`` (process-wide: True while a micro-batch thread is registered);
    ``current``: ``dbo_current_ubatch_id`` (the calling micro-batch thread's index);
    ``hand_over``: ``dbo_yield`` (park this thread, run the next micro-batch until it yields back).
    """

    active: Callable[[], bool]
    current: Callable[[], int]
    hand_over: Callable[[], None]


class SplitStep:
    """One micro-batched engine step: its micro-batch count, failure mark and hand-off timing.

    Created by the runner for each split step and made current for the process
    (:func:`open_step`); the MoE seam reads it from the micro-batch threads.
    """

    def __init__(self, num_ubatches: int, handoff: Handoff) -> None:
        if num_ubatches < 2:
            raise ValueError(f"a split step has at least 2 micro-batches, got {num_ubatches}")
        self.num_ubatches = num_ubatches
        self.handoff = handoff
        self._lock = threading.Lock()
        self._failure: tuple[int, BaseException] | None = None
        #: perf_counter_ns at which each micro-batch last got the core (the start of its compute span)
        self.resumed_ns: dict[int, int] = {}
        self.hand_overs = 0

    # ------------------------------------------------------------------ failure

    def fail(self, ubatch: int, exc: BaseException) -> None:
        """Mark the step failed by micro-batch ``ubatch`` (the first failure is kept)."""
        with self._lock:
            if self._failure is None and not isinstance(exc, SiblingFailed):
                self._failure = (ubatch, exc)

    @property
    def failure(self) -> tuple[int, BaseException] | None:
        """``(micro-batch, exception)`` of the first failure, or None."""
        return self._failure

    def check(self, ubatch: int) -> None:
        """Raise :class:`SiblingFailed` in micro-batch ``ubatch`` if another one failed."""
        failure = self._failure
        if failure is not None and failure[0] != ubatch:
            failed, exc = failure
            raise SiblingFailed(
                f"micro-batch {ubatch} of {self.num_ubatches} stopped: micro-batch {failed} failed "
                f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"
            )

    # ------------------------------------------------------------------ hand-off

    def resumed(self, ubatch: int) -> None:
        """Micro-batch ``ubatch`` has the core now (its thread started, or a hand-off came back)."""
        self.resumed_ns[ubatch] = time.perf_counter_ns()

    def hand_over(self, ubatch: int) -> tuple[int, int]:
        """Yield to the sibling micro-batch; returns this micro-batch's compute span before the yield
        ``(resumed_ns, yielded_ns)``.  Raises :class:`SiblingFailed` when a sibling failed meanwhile."""
        yielded = time.perf_counter_ns()
        span = (self.resumed_ns.get(ubatch, yielded), yielded)
        self.hand_overs += 1
        self.handoff.hand_over()
        self.resumed(ubatch)
        self.check(ubatch)
        return span


_CURRENT: SplitStep | None = None
_CURRENT_LOCK = threading.Lock()


def open_step(step: SplitStep) -> None:
    """Make ``step`` the process's current split step (the runner, before its threads start)."""
    global _CURRENT
    with _CURRENT_LOCK:
        if _CURRENT is not None:
            raise RuntimeError("a split step is already open in this process: steps do not nest")
        _CURRENT = step


def close_step(step: SplitStep) -> None:
    """End ``step`` (the runner, after its threads joined)."""
    global _CURRENT
    with _CURRENT_LOCK:
        if _CURRENT is step:
            _CURRENT = None


def current_step() -> SplitStep | None:
    """The open split step, or None while the engine runs unsplit."""
    return _CURRENT
