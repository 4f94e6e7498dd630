"""The executor on real threads (host backend): call order, outputs, failure, shutdown."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from afd_mrv2 import hookimpl
from afd_mrv2.bench.noop import NoopConnector
from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import HostBackend, RecordingBackend
from afd_mrv2.errors import PipelineAborted, PipelineError, PluginError
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import plugins_for
from tests.connectors import CountingRecording, PhaseObserver, RecordingConnector, grid, item_inputs, matmul_compute


def stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("afd-stream-")]


def make(
    connector: object, *, enabled: bool, depth: int = 2, backend=None, observers=None, trace=None, **extra
) -> Executor:
    config = MultistreamConfig(enabled=enabled, depth=depth, close_timeout_s=2.0, **extra)
    return Executor(
        plugins_for(connector, observers=observers),
        backend or HostBackend(),
        config,
        compute=matmul_compute(),
        trace=trace,
    )


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    yield
    deadline = time.monotonic() + 2
    while stream_threads() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_serialized_and_pipelined_make_identical_calls_and_outputs() -> None:
    torch.set_num_threads(1)
    items = grid(3, 2, 8)
    runs = {}
    for enabled in (False, True):
        connector = RecordingConnector(sleep_s={"recv": 0.001, "send": 0.001})
        with make(connector, enabled=enabled, depth=3) as executor:
            executor.run(items)
        runs[enabled] = connector
    serial, piped = runs[False], runs[True]
    for item in items:
        assert (
            serial.sequence(item)
            == piped.sequence(item)
            == [(phase, (item.seq % 3, item.seq % 3)) for phase in ("recv", "compute", "send")]
        )
    for phase in ("recv", "compute", "send"):
        assert serial.order(phase) == piped.order(phase) == items
    assert serial.outputs.keys() == piped.outputs.keys() == set(items)
    for item in items:
        assert torch.equal(serial.outputs[item], piped.outputs[item])
        assert torch.equal(serial.outputs[item], matmul_compute()(item, item_inputs(item)))
    # the pipelined run really used three threads, the serialized one a single thread
    assert len({c.thread for c in piped.calls}) == 3
    assert len({c.thread for c in serial.calls}) == 1


def test_pipelined_run_overlaps_phases_in_its_trace() -> None:
    """Overlap read off the trace, not off wall time (a loaded 2-core machine makes wall-time bounds flaky).

    Serialized: no two phases ever overlap.  Pipelined at depth 3 with sleep-only
    phases: every steady-state item's recv overlaps an earlier item's compute on
    another stream.  Speedups are measured side by side by ``afd-mrv2 demo``.
    """
    items = grid(2, 2, 2)

    def overlapping_pairs(trace: Trace) -> set[tuple[int, int]]:
        spans = trace.spans
        return {
            (a.item.seq, b.item.seq)
            for a in spans
            for b in spans
            if a.item != b.item and a.stream_id != b.stream_id and a.start_ns < b.end_ns and b.start_ns < a.end_ns
        }

    traces = {}
    for enabled in (False, True):
        connector = RecordingConnector(sleep_s={"recv": 0.02, "compute": 0.02, "send": 0.02})
        traces[enabled] = Trace()
        with make(connector, enabled=enabled, depth=3, trace=traces[enabled]) as executor:
            executor.run(items)
    assert overlapping_pairs(traces[False]) == set()
    pipelined = overlapping_pairs(traces[True])
    seqs = [item.seq for item in items]
    assert all((later, earlier) in pipelined for earlier, later in itertools.pairwise(seqs)), sorted(pipelined)


def test_failure_in_compute_cleans_every_in_flight_item_once() -> None:
    connector = RecordingConnector(sleep_s={"recv": 0.01, "send": 0.02}, fail=("compute", 7))
    executor = make(connector, enabled=True, depth=3)
    submitted = []
    with pytest.raises(PipelineError) as info:
        for item in grid(3, 2, 4):
            executor.submit(item)
            submitted.append(item)
        executor.drain()
    error = info.value
    assert "on_compute failed for work item layer=0 stage=1 seq=7" in str(error)
    assert "planted failure in compute" in str(error)
    assert error.item == WorkItem(0, 1, 7) and error.phase == "compute"
    assert isinstance(error.__cause__, RuntimeError)
    sent = set(connector.outputs)
    in_flight = [item for item in submitted if item not in sent]
    cleaned = [item for item, _ in connector.cleanups]
    assert cleaned == in_flight  # exactly once each, in issue order
    assert WorkItem(0, 1, 7) in cleaned
    assert 1 <= len(cleaned) <= 3 + 3  # at most depth_in + depth_out items are in flight
    assert all(isinstance(reason, RuntimeError) for _, reason in connector.cleanups)
    start = time.monotonic()
    report = executor.close()
    assert time.monotonic() - start < 2.0
    assert report.abandoned == in_flight and report.error is error.__cause__
    assert not stream_threads()
    with pytest.raises(PipelineError):
        executor.submit(WorkItem(9, 9, 99))


def test_failure_surfaces_from_drain_too() -> None:
    connector = RecordingConnector(fail=("send", 2))
    executor = make(connector, enabled=True, depth=4)
    with pytest.raises(PipelineError, match="on_send failed for work item layer=0 stage=0 seq=2"), executor:
        for item in [WorkItem(0, 0, i) for i in range(3)]:
            executor.submit(item)
        executor.drain()
    assert [item for item, _ in connector.cleanups] == [WorkItem(0, 0, 2)]


def test_close_abandons_a_receive_that_never_returns() -> None:
    connector = RecordingConnector(block=("recv", 2))
    executor = make(connector, enabled=True, depth=3)
    for item in [WorkItem(0, 0, i) for i in range(4)]:
        executor.submit(item)
    start = time.monotonic()
    report = executor.close(0.5)
    elapsed = time.monotonic() - start
    # its own deadline (0.5 s), not the configured close_timeout_s (2 s): the slack is the machine's load
    assert elapsed < 0.5 + 1.0, elapsed
    assert report.abandoned == [WorkItem(0, 0, 2), WorkItem(0, 0, 3)]
    assert report.abandoned_streams == {"recv": "recv of layer=0 stage=0 seq=2"}
    assert isinstance(report.error, PipelineAborted)
    assert [item for item, _ in connector.cleanups] == report.abandoned
    assert "abandoned streams: recv (recv of layer=0 stage=0 seq=2)" in report.describe()
    connector.never.set()  # let the abandoned daemon thread go


def test_close_cancels_a_cooperative_blocked_receive_without_abandoning_threads() -> None:
    connector = RecordingConnector(block_cooperative=("recv", 1))
    executor = make(connector, enabled=True, depth=2)
    executor.submit(WorkItem(0, 0, 0))
    executor.submit(WorkItem(0, 0, 1))
    start = time.monotonic()
    report = executor.close(0.3)
    assert time.monotonic() - start < 0.3 + 1.0  # within its deadline, not close_timeout_s (2 s), give or take load
    assert report.abandoned == [WorkItem(0, 0, 1)]
    assert report.abandoned_streams == {}
    assert not stream_threads()


def test_clean_close_reports_clean() -> None:
    executor = make(RecordingConnector(), enabled=True)
    executor.run(grid(1, 1, 5))
    report = executor.close()
    assert report.clean and report.describe() == "closed cleanly"
    assert executor.close() is report  # idempotent
    assert not stream_threads()


def test_seq_must_increase() -> None:
    with make(RecordingConnector(), enabled=False) as executor:
        executor.submit(WorkItem(0, 0, 5))
        with pytest.raises(ValueError, match="increasing seq"):
            executor.submit(WorkItem(0, 1, 5))


def test_observer_wraps_every_phase_on_the_same_thread() -> None:
    observer = PhaseObserver()
    connector = RecordingConnector()
    with make(connector, enabled=True, observers={"watch": observer}) as executor:
        executor.run(grid(1, 2, 3))
    assert sorted(observer.seen, key=lambda s: (s[1].seq, s[0])) == sorted(
        [(c.phase, c.item, False) for c in connector.calls], key=lambda s: (s[1].seq, s[0])
    )


def test_stream_layouts() -> None:
    serial = make(NoopConnector(), enabled=False, backend=RecordingBackend())
    assert len({id(s) for s in serial.streams.values()}) == 1
    piped = make(NoopConnector(), enabled=True, backend=RecordingBackend())
    assert len({id(s) for s in piped.streams.values()}) == 3
    send_only = make(NoopConnector(), enabled=True, backend=RecordingBackend(), phases=("send",))
    assert send_only.streams["recv"] is send_only.streams["compute"] is not send_only.streams["send"]
    other_role = Executor(
        plugins_for(NoopConnector()),
        RecordingBackend(),
        MultistreamConfig(enabled=True, roles=("ffn",)),
        compute=None,
        role="attention",
    )
    assert not other_role.pipelined and len({id(s) for s in other_role.streams.values()}) == 1


class StreamChooser(NoopConnector):
    def __init__(self, result: object) -> None:
        super().__init__()
        self.result = result

    @hookimpl
    def create_streams(self, backend, roles, config):  # type: ignore[no-untyped-def]
        return self.result(backend) if callable(self.result) else self.result


def test_connector_may_override_create_streams_through_the_backend() -> None:
    def layout(backend):  # type: ignore[no-untyped-def]
        comm = backend.new_stream("comm")
        return {"recv": comm, "send": comm, "compute": backend.new_stream("main")}

    executor = make(StreamChooser(layout), enabled=True, backend=RecordingBackend())
    assert executor.streams["recv"] is executor.streams["send"] and executor.streams["recv"].name == "comm"
    with pytest.raises(PipelineError, match="create_streams returned"):
        make(StreamChooser({"recv": None}), enabled=True, backend=RecordingBackend())


def test_no_event_allocation_after_start_up() -> None:
    backend = CountingRecording()
    executor = make(NoopConnector(), enabled=True, depth=4, backend=backend, trace=Trace())
    assert backend.created.count("event") == 24  # (ready + free + one done event) x (4 in + 4 out slots)
    executor.run(grid(3, 2, 16))
    assert backend.created.count("event") == 24


def test_plugins_for_rejects_wrong_kinds() -> None:
    with pytest.raises(PluginError, match="does not implement the phase hooks"):
        plugins_for(PhaseObserver())
    with pytest.raises(PluginError, match="implements phase hooks as a connector"):
        plugins_for(NoopConnector(), observers={"x": NoopConnector()})


def test_wait_for_waits_for_one_item_not_a_drain() -> None:
    connector = RecordingConnector(block=("recv", 1))
    executor = make(connector, enabled=True, depth=2)
    first, second = WorkItem(0, 0, 0), WorkItem(0, 1, 1)
    executor.submit(first)
    executor.submit(second)  # its recv blocks until `never` is set
    executor.wait_for(0)
    assert first in connector.outputs and executor.in_flight == [second]
    executor.wait_for(0)  # already released: returns at once
    with pytest.raises(ValueError, match="no work item with seq=5"):
        executor.wait_for(5)
    connector.never.set()
    executor.wait_for(1)
    assert executor.in_flight == [] and second in connector.outputs
    for seq in range(2, 12):  # one item at a time, never drained: done events are recycled
        executor.submit(WorkItem(0, 0, seq))
        executor.wait_for(seq)
    assert executor.close().clean


def test_wait_for_raises_the_failure_with_the_item() -> None:
    executor = make(RecordingConnector(fail=("send", 0)), enabled=True)
    executor.submit(WorkItem(0, 0, 0))
    with pytest.raises(PipelineError, match="on_send failed for work item layer=0 stage=0 seq=0"):
        executor.wait_for(0)
