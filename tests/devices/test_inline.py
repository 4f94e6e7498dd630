"""The inline backend: each stream runs its work at once, on the submitting thread, in the device-stream contract."""

from __future__ import annotations

import threading

import pytest
import torch

from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import HostBackend, InlineBackend
from afd_mrv2.devices.base import Span
from afd_mrv2.errors import PipelineAborted, PipelineError
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.plugins import plugins_for
from tests.connectors import RecordingConnector, grid, item_inputs, matmul_compute


def test_work_runs_before_submit_returns_on_the_callers_thread_and_events_complete_at_record() -> None:
    backend = InlineBackend()
    stream, other = backend.new_stream("serial"), backend.current_stream("compute")
    ran: list[tuple[str, threading.Thread]] = []
    event = backend.new_event()
    assert event.query() and event.synchronize(0)  # never recorded: complete
    span = Span("recv", "serial", stream.stream_id, None, None)
    stream.submit(lambda: ran.append(("a", threading.current_thread())), span)
    assert ran == [("a", threading.current_thread())] and span.end_ns >= span.start_ns > 0
    stream.record(event)
    assert event.query() and event.synchronize(0)
    other.wait(event)  # nothing left to wait for
    other.submit(lambda: ran.append(("b", threading.current_thread())))
    assert [name for name, _ in ran] == ["a", "b"] and backend.threads() == []
    assert backend.close(0).clean
    with pytest.raises(RuntimeError, match="inline backend is closed"):
        backend.new_stream("late")


def test_a_failure_aborts_skips_later_work_and_later_events_never_complete() -> None:
    backend = InlineBackend()
    stream = backend.new_stream("serial")
    ran: list[int] = []
    stream.submit(lambda: 1 / 0)
    assert backend.aborted and isinstance(backend.errors[0][1], ZeroDivisionError)
    stream.submit(lambda: ran.append(1))
    event = backend.new_event()
    stream.record(event)
    assert ran == [] and not event.query()
    with pytest.raises(PipelineAborted):
        event.synchronize(1)
    with pytest.raises(TypeError, match="not an event of this backend"):
        stream.record(HostBackend().new_event())


def _serialized(connector: object, backend: object) -> Executor:
    config = MultistreamConfig(enabled=False, depth=2, close_timeout_s=2.0)
    return Executor(plugins_for(connector), backend, config, compute=matmul_compute())  # type: ignore[arg-type]


def test_a_serialized_executor_on_it_makes_the_host_backends_calls_and_outputs_on_the_callers_thread() -> None:
    torch.set_num_threads(1)
    items = grid(3, 2, 8)
    runs = {}
    for name, backend in (("host", HostBackend()), ("inline", InlineBackend())):
        connector = RecordingConnector()
        with _serialized(connector, backend) as executor:
            executor.run(items)
        runs[name] = connector
    host, inline = runs["host"], runs["inline"]
    for item in items:
        assert inline.sequence(item) == host.sequence(item)
        assert torch.equal(inline.outputs[item], matmul_compute()(item, item_inputs(item)))
        assert torch.equal(inline.outputs[item], host.outputs[item])
    me = threading.current_thread().name
    assert {c.thread for c in inline.calls} == {me} and me not in {c.thread for c in host.calls}


def test_a_failed_phase_surfaces_from_wait_for_naming_the_item_and_cleans_up() -> None:
    connector = RecordingConnector(fail=("send", 2))
    executor = _serialized(connector, InlineBackend())
    for item in [WorkItem(0, 0, i) for i in range(3)]:
        executor.submit(item)  # the failing send ran inside this call; the failure waits for a wait
    with pytest.raises(PipelineError, match="on_send failed for work item layer=0 stage=0 seq=2"):
        executor.wait_for(2)
    report = executor.close()
    assert [item for item, _ in connector.cleanups] == [WorkItem(0, 0, 2)] and report.abandoned == [WorkItem(0, 0, 2)]


def test_phases_run_outside_the_callers_inference_mode() -> None:
    backend = InlineBackend()
    stream = backend.new_stream("serial")
    buffers: list[torch.Tensor] = []
    with torch.inference_mode():
        stream.submit(lambda: buffers.append(torch.zeros(4)))
    stream.submit(lambda: buffers[0].add_(1))  # a buffer made by a call under inference mode, written outside it
    with torch.inference_mode():
        stream.submit(lambda: buffers[0].add_(1))
    assert not backend.errors and not buffers[0].is_inference() and buffers[0].tolist() == [2.0] * 4
