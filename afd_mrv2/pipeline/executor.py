"""The shared executor: bounded input and output buffer slots, explicit event edges.

:class:`Executor` (``submit``, ``wait_for``, ``drain``, ``run``, ``close``); see also docs/pipeline.md.

See docs/internals/pipeline.md, "afd_mrv2.pipeline.executor".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices.base import DeviceBackend, Event, Stream
from afd_mrv2.errors import PipelineAborted, PipelineError, PluginError
from afd_mrv2.hookspecs import ComputeFn
from afd_mrv2.items import PHASES, WorkItem
from afd_mrv2.pipeline.autodepth import DepthChoice, DepthTuner
from afd_mrv2.pipeline.buffer_bytes import BufferBytes, measure_slots
from afd_mrv2.pipeline.close_report import CloseReport, Failure, clean_up
from afd_mrv2.pipeline.events import EventPool
from afd_mrv2.pipeline.inflight import InFlight
from afd_mrv2.pipeline.spans import SpanCollector
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import Plugins
from afd_mrv2.work import INPUT, OUTPUT, BufferSlot, Work

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a host wait re-checks for failures and deadlines


class Executor:
    """Runs work items through one connector's phase hooks; see docs/internals/pipeline.md.

    :param plugins: the registered connector and observers (:func:`load_plugins`).
    :param backend: the stream/event backend.
    :param config: the ``afd.multistream`` section.
    :param compute: the owner's compute function, passed to ``on_compute``.
    :param role: the AFD role this executor serves (``multistream.roles`` decides
        whether it pipelines).
    :param trace: where to collect one span per phase, or None.
    :param tuner: the ``depth: "auto"`` tuner; by default one is built when the
        config asks for auto depth and this executor pipelines.
    """

    def __init__(
        self,
        plugins: Plugins,
        backend: DeviceBackend,
        config: MultistreamConfig,
        *,
        compute: ComputeFn,
        role: str = "ffn",
        trace: Trace | None = None,
        tuner: DepthTuner | None = None,
    ) -> None:
        self.config = config
        self.pipelined = config.active_for(role)
        allocated_in, allocated_out = config.buffer_counts
        if tuner is None and config.auto_depth and self.pipelined:
            tuner = DepthTuner(config.auto_window, max(allocated_in, allocated_out))
        self._tuner = tuner
        self.depth_in, self.depth_out = allocated_in, allocated_out
        self.backend = backend
        self.trace = trace
        self._spans = SpanCollector(backend, trace=trace, tuner=tuner)
        self._compute = compute
        self._plugins = plugins
        # hook API 0 (no hook_api_version): its one slot per item lives until its send, so send frees inputs
        self._api0 = plugins.legacy_slots
        hook = plugins.hook
        self._hook = hook
        self._phase_hooks: dict[str, Callable[..., object]] = {
            "recv": hook.on_recv,
            "compute": hook.on_compute,
            "send": hook.on_send,
        }
        stream_config = config if self.pipelined else replace(config, enabled=False)
        self.streams = self._create_streams(stream_config)
        self._pool = EventPool(backend, 3 * (allocated_in + allocated_out))
        self.inputs = [BufferSlot(INPUT, i, self._pool.take(), self._pool.take()) for i in range(allocated_in)]
        self.outputs = [BufferSlot(OUTPUT, i, self._pool.take(), self._pool.take()) for i in range(allocated_out)]
        self._in_flight = InFlight([self._pool.take() for _ in range(allocated_in + allocated_out)])
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._failure: Failure | None = None
        self._issued = 0
        self._cursor = 0  # slot binding counter (restarts when auto depth decides)
        self._last_seq: int | None = None
        self._report: CloseReport | None = None
        self._retired: list[BufferSlot] = []  # slots auto depth stopped using, still holding buffers

    # ------------------------------------------------------------------ set-up

    def _create_streams(self, config: MultistreamConfig) -> dict[str, Stream]:
        try:
            return self._plugins.create_streams(self.backend, PHASES, config)
        except PluginError as exc:
            raise PipelineError(str(exc)) from None

    # ------------------------------------------------------------------ public API

    @property
    def closed(self) -> bool:
        return self._report is not None

    @property
    def depth(self) -> int:
        """The larger of the two buffer counts (the simple knob ``multistream.depth``)."""
        return max(self.depth_in, self.depth_out)

    @property
    def in_flight(self) -> list[WorkItem]:
        """Items issued whose on_send has not returned, in issue order."""
        return [w.item for w in self._in_flight.unsent()]

    def buffer_bytes(self) -> BufferBytes:
        """Bytes the connector's buffers hold now, measured from their tensors' storages."""
        return measure_slots(self.inputs, self.outputs)

    def submit(self, item: WorkItem) -> None:
        """Issue ``item``; blocks while its input slot's previous item has not finished compute.

        Raises :class:`PipelineError` (naming the failed item and phase) once any
        phase has failed, and after ``close``.
        """
        self._check_open()
        if self._last_seq is not None and item.seq <= self._last_seq:
            raise ValueError(f"work items must be submitted in increasing seq order: {item} after seq={self._last_seq}")
        if self._tuner is not None and self._tuner.measuring and self._issued >= self._tuner.window:
            self._maybe_decide_depth()
        inputs = self.inputs[self._cursor % self.depth_in]
        outputs = self.outputs[self._cursor % self.depth_out]
        self._await(inputs.free, None)  # the input slot's previous item consumed its inputs
        self._reap()
        if self._in_flight.full:  # not in the steady state (see docs/internals/pipeline.md)
            self._await(self._in_flight.pending()[0][1], None)
            self._reap()
        work = Work(item, inputs, outputs, self._cancel, _api0=self._api0)
        inputs.item = outputs.item = item
        self._last_seq = item.seq
        self._issued += 1
        self._cursor += 1
        self._issue(work, self._in_flight.add(work))

    def wait_for(self, seq: int) -> None:
        """Wait until the send of item ``seq`` completed, then release it.

        A host wait on that item's ``done`` event only: never a drain of other items,
        never a device-wide synchronize.  Earlier items whose send completed are
        released too (without blocking).  Returns at once if the item was already
        released; raises like ``submit`` if any phase failed.
        """
        self._check_open()
        done = self._in_flight.done_event(seq)
        if done is None:
            if self._last_seq is None or seq > self._last_seq:
                raise ValueError(f"no work item with seq={seq} was submitted")
            return
        self._await(done, None)
        self._reap()
        if seq in self._in_flight:  # an earlier item's send is still running (sends on several streams)
            self._release(seq)

    def drain(self) -> None:
        """Wait until every issued item completed; raise if any phase failed."""
        self._check_open()
        self._wait_all(None)

    def run(self, items: Iterable[WorkItem]) -> None:
        """``submit`` every item, then ``drain``."""
        for item in items:
            self.submit(item)
        self.drain()

    def _written_report(self) -> CloseReport:
        """The report a failure wrote (a side effect mypy cannot see through ``_wait_all``)."""
        assert self._report is not None
        return self._report

    def close(self, deadline_s: float | None = None) -> CloseReport:
        """Finish in-flight work within ``deadline_s`` seconds, else abandon it.

        Returns within ``deadline_s`` plus a small grace period (threads blocked
        inside a hook are left behind as daemons and reported, never joined
        forever).  Abandoned items get ``on_cleanup``.  Idempotent.
        """
        if self._report is not None:
            return self._report
        timeout = self.config.close_timeout_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + timeout
        error: BaseException | None = None
        if self._failure is None:
            try:
                if not self._wait_all(deadline):
                    error = PipelineAborted(f"closed after {timeout:g} s with work in flight")
            except PipelineError:
                # a phase failed while draining; _raise_failure stopped us and wrote the report
                return self._written_report()
        if self._failure is not None:
            error = self._failure.error
        return self._stop(error, deadline)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ issuing

    def _issue(self, work: Work, done: Event) -> None:
        inputs, outputs = work.inputs, work.outputs
        recv, compute, send = self.streams["recv"], self.streams["compute"], self.streams["send"]
        if recv is not compute:
            recv.wait(inputs.free)  # input reuse edge: the previous item's compute consumed them
        self._submit_phase("recv", recv, work)
        if compute is not recv:
            recv.record(inputs.ready)
            compute.wait(inputs.ready)
        if send is not compute:
            compute.wait(outputs.free)  # output reuse edge: the previous item's send completed
        self._submit_phase("compute", compute, work)
        if not self._api0:
            compute.record(inputs.free)
        if send is not compute:
            compute.record(outputs.ready)
            send.wait(outputs.ready)
        self._submit_phase("send", send, work)
        if self._api0:
            send.record(inputs.free)
        send.record(outputs.free)
        send.record(done)

    def _submit_phase(self, phase: str, stream: Stream, work: Work) -> None:
        stream.submit(self._phase_runner(phase, stream, work), self._spans.open(phase, stream, work))

    def _phase_runner(self, phase: str, stream: Stream, work: Work) -> Callable[[], None]:
        hook = self._phase_hooks[phase]
        cancel = self._cancel

        def run() -> None:
            if cancel.is_set():
                return
            try:
                if phase == "compute":
                    hook(work=work, stream=stream, compute=self._compute)
                else:
                    hook(work=work, stream=stream)
                    if phase == "send":
                        self._in_flight.sent.add(work.item.seq)
            except BaseException as exc:  # noqa: BLE001 - reported with the item's identity
                self._fail(exc, work.item, phase)

        return run

    @property
    def depth_choice(self) -> DepthChoice | None:
        """The ``depth: "auto"`` decision, once made (None before, or with a fixed depth)."""
        return None if self._tuner is None else self._tuner.choice

    def _maybe_decide_depth(self) -> None:
        """Choose the buffer counts once the window's items completed; never drains.

        Completed items are released without blocking; once every window item is
        measured the counts shrink in place: new items bind to the first
        ``depth_in`` / ``depth_out`` slots, and a slot still busy with an older
        item is waited for through its events as usual.
        """
        assert self._tuner is not None
        self._reap()
        if self._tuner.ready():
            sizes = self.buffer_bytes()
            choice = self._tuner.decide(sizes.per_input, sizes.per_output)
            self.depth_in, self.depth_out = choice.depth_in, choice.depth_out
            self._cursor = 0
            # Slots beyond the chosen counts are never bound again: their buffers are
            # dropped as soon as the item last bound to them is released.
            self._retired = self.inputs[self.depth_in :] + self.outputs[self.depth_out :]
            self._drop_retired()

    # ------------------------------------------------------------------ waiting and release

    def _reap(self) -> None:
        """Release, in issue order, every item whose send completed (checked without blocking)."""
        for seq in self._in_flight.completed():
            self._release(seq)

    def _release(self, seq: int) -> None:
        self._in_flight.release(seq)
        self._spans.release(seq)
        if self._retired:
            self._drop_retired()

    def _drop_retired(self) -> None:
        for slot in list(self._retired):
            if slot.item is None or slot.item.seq not in self._in_flight:
                slot.state = None
                self._retired.remove(slot)

    def _wait_all(self, deadline: float | None) -> bool:
        """Wait for every issued item's send, in issue order; False at ``deadline``."""
        for seq, done in self._in_flight.pending():
            if not self._await(done, deadline):
                return False
            self._release(seq)
        return True

    def _await(self, event: Event, deadline: float | None) -> bool:
        while True:
            try:
                done = event.synchronize(timeout=_POLL_S)
            except PipelineAborted:
                done = False
            if self._failure is not None:
                self._raise_failure()
            if done:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    # ------------------------------------------------------------------ failure and stop

    def _fail(self, error: BaseException, item: WorkItem | None, phase: str | None) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = Failure(error, item, phase)
        self._cancel.set()
        self.backend.abort()

    def _check_open(self) -> None:
        if self._failure is not None:
            self._raise_failure()
        if self._report is not None:
            raise PipelineError("the executor is closed")

    def _raise_failure(self) -> None:
        failure = self._failure
        assert failure is not None
        if self._report is None:
            self._stop(failure.error, time.monotonic() + self.config.close_timeout_s)
        raise failure.as_error() from failure.error

    def _stop(self, error: BaseException | None, deadline: float) -> CloseReport:
        """Stop everything, clean up abandoned items once each, and record the report."""
        if error is not None or self.in_flight:
            self._cancel.set()
            self.backend.abort()
        streams = self.backend.close(deadline)
        # Only now, with the streams stopped (or abandoned), is "in flight" final: a
        # send that was running when we aborted may have completed meanwhile.
        abandoned = self._in_flight.unsent()
        reason = error if error is not None else PipelineAborted("abandoned at close")
        clean_up(self._hook.on_cleanup, abandoned, reason)
        self._in_flight.clear()
        self._report = CloseReport(
            abandoned=[w.item for w in abandoned],
            abandoned_streams=dict(streams.abandoned_streams),
            error=error,
        )
        if not self._report.clean:
            log.warning("afd-mrv2 executor stopped: %s", self._report.describe())
        return self._report
