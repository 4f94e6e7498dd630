"""The recording backend's op log and the happens-before checker."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afd_mrv2.config import BufferCounts, MultistreamConfig
from afd_mrv2.devices import RecordingBackend
from afd_mrv2.devices.base import Event
from afd_mrv2.devices.recording import Op
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.plugins import plugins_for
from afd_mrv2.work import Work
from tests.connectors import RecordingConnector, grid, matmul_compute
from tests.support.happens_before import HappensBeforeError, check_happens_before, find_violations


class DropsInputReuseEdge(Executor):
    """TEST-ONLY planted bug: recv overwrites an input slot without waiting for the previous compute.

    ``inputs.free`` is never recorded, so both the host wait and the device-side
    wait on it are no-ops.
    """

    def _issue(self, work: Work, done: Event) -> None:
        inputs, outputs = work.inputs, work.outputs
        recv, compute, send = self.streams["recv"], self.streams["compute"], self.streams["send"]
        self._submit_phase("recv", recv, work)
        recv.record(inputs.ready)
        compute.wait(inputs.ready)
        compute.wait(outputs.free)
        self._submit_phase("compute", compute, work)
        compute.record(outputs.ready)
        send.wait(outputs.ready)
        self._submit_phase("send", send, work)
        send.record(outputs.free)
        send.record(done)


class DropsOutputReuseEdge(Executor):
    """TEST-ONLY planted bug: compute overwrites an output slot without waiting for the previous send."""

    def _issue(self, work: Work, done: Event) -> None:
        inputs, outputs = work.inputs, work.outputs
        recv, compute, send = self.streams["recv"], self.streams["compute"], self.streams["send"]
        recv.wait(inputs.free)
        self._submit_phase("recv", recv, work)
        recv.record(inputs.ready)
        compute.wait(inputs.ready)
        self._submit_phase("compute", compute, work)
        compute.record(inputs.free)
        compute.record(outputs.ready)
        send.wait(outputs.ready)
        self._submit_phase("send", send, work)
        send.record(outputs.free)
        send.record(done)


def run(
    executor_type: type[Executor],
    *,
    enabled: bool,
    depth: int,
    buffers: tuple[int, int] | None = None,
    items: list[WorkItem] | None = None,
    backend: RecordingBackend | None = None,
    **extra: object,
) -> tuple[RecordingBackend, RecordingConnector]:
    backend = backend or RecordingBackend()
    connector = RecordingConnector()
    counts = None if buffers is None else BufferCounts(*buffers)
    config = MultistreamConfig(enabled=enabled, depth=depth, buffers=counts, **extra)
    executor = executor_type(plugins_for(connector), backend, config, compute=matmul_compute())
    with executor:
        executor.run(items if items is not None else grid(3, 2, 16))
    return backend, connector


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("enabled", [True, False])
def test_executor_schedule_is_proven_for_3_layers_2_stages_16_items(depth: int, enabled: bool) -> None:
    backend, connector = run(Executor, enabled=enabled, depth=depth)
    assert len(connector.outputs) == 3 * 2 * 16
    submits = [op for op in backend.log if op.kind == "submit"]
    assert len(submits) == 3 * 96
    check_happens_before(backend.log)
    # The device edges alone suffice: correctness never depends on the host wait.
    check_happens_before(backend.log, host_edges=False)


@pytest.mark.parametrize(("depth_in", "depth_out"), [(1, 1), (2, 2), (3, 2), (2, 3), (1, 4), (4, 1)])
def test_planted_bug_dropping_compute_done_is_caught_as_input_reuse(depth_in: int, depth_out: int) -> None:
    backend, connector = run(DropsInputReuseEdge, enabled=True, depth=2, buffers=(depth_in, depth_out))
    assert len(connector.outputs) == 96  # program order still gives the right numbers here...
    violations = find_violations(backend.log)
    assert violations and {v.rule for v in violations} == {"input-reuse"}  # ...but a device could race
    assert len(violations) == 96 - depth_in  # every input slot reuse is unguarded
    with pytest.raises(HappensBeforeError, match=r"recv of \(layer=\d stage=\d seq=\d+\) may overwrite input slot"):
        check_happens_before(backend.log)


@pytest.mark.parametrize(("depth_in", "depth_out"), [(1, 1), (2, 2), (3, 2), (2, 3), (1, 4), (4, 1)])
def test_planted_bug_dropping_send_done_is_caught_as_output_reuse(depth_in: int, depth_out: int) -> None:
    backend, connector = run(DropsOutputReuseEdge, enabled=True, depth=2, buffers=(depth_in, depth_out))
    assert len(connector.outputs) == 96
    violations = find_violations(backend.log, host_edges=False)
    assert violations and {v.rule for v in violations} == {"output-reuse"}
    assert len(violations) == 96 - depth_out  # every output slot reuse is unguarded on the device
    with pytest.raises(HappensBeforeError, match=r"compute of \(layer=\d stage=\d seq=\d+\) may overwrite output"):
        check_happens_before(backend.log, host_edges=False)


PHASE_SETS = [("recv", "send"), ("recv",), ("send",)]


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth_in=st.integers(1, 4),
    depth_out=st.integers(1, 4),
    auto=st.booleans(),
    enabled=st.booleans(),
    phases=st.sampled_from(PHASE_SETS),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 6)),
    durations=st.lists(st.integers(1, 5_000), min_size=3, max_size=24),
)
def test_random_schedules_with_random_phase_durations_are_proven(
    depth_in: int,
    depth_out: int,
    auto: bool,
    enabled: bool,
    phases: tuple[str, ...],
    shape: tuple[int, int, int],
    durations: list[int],
) -> None:
    """The simulated device gives every op a random duration, which changes what the
    executor observes (releases, the auto-depth measurement) and so what it issues."""
    table = iter(durations * 1000)
    backend = RecordingBackend(durations=lambda span: next(table))
    items = grid(*shape)
    buffers = None if auto else (depth_in, depth_out)
    _, connector = run(
        Executor,
        enabled=enabled,
        depth="auto" if auto else 2,
        buffers=buffers,
        items=items,
        backend=backend,
        phases=phases,
        auto_window=2,
    )
    assert sorted(connector.outputs) == sorted(items)
    assert find_violations(backend.log, host_edges=False) == []


def test_pipelined_log_has_cross_stream_waits_serialized_has_none() -> None:
    piped, _ = run(Executor, enabled=True, depth=2)
    serial, _ = run(Executor, enabled=False, depth=2)
    assert {op.stream for op in piped.log if op.kind == "submit"} == {"recv", "compute", "send"}
    assert any(op.kind == "wait" for op in piped.log)
    assert {op.stream for op in serial.log if op.kind == "submit"} == {"serial"}
    assert not any(op.kind == "wait" for op in serial.log)


def _submit(stream: str, name: str, seq: int, slot: int = 0) -> Op:
    return Op("submit", stream, name=name, item=WorkItem(0, 0, seq), slots=(slot, slot))


def test_checker_rules_on_hand_written_logs() -> None:
    # recv and compute on different streams with no edge: a device may run them in any order
    log = [_submit("r", "recv", 0), _submit("c", "compute", 0), _submit("c", "send", 0)]
    assert {v.rule for v in find_violations(log)} == {"recv->compute"}
    # the same with an event edge is proven
    log = [
        _submit("r", "recv", 0),
        Op("record", "r", 1),
        Op("wait", "c", 1, bound=1),
        _submit("c", "compute", 0),
        _submit("c", "send", 0),
    ]
    assert find_violations(log) == []
    # a wait bound to no record (the event was never recorded) proves nothing
    log = [_submit("r", "recv", 0), Op("wait", "c", 1, bound=None), _submit("c", "compute", 0), _submit("c", "send", 0)]
    assert {v.rule for v in find_violations(log)} == {"recv->compute"}
    # a host sync on the record orders everything the host issues afterwards
    log = [
        _submit("r", "recv", 0),
        Op("record", "r", 1),
        Op("sync", None, 1, bound=1),
        _submit("c", "compute", 0),
        _submit("c", "send", 0),
    ]
    assert find_violations(log) == []
    assert {v.rule for v in find_violations(log, host_edges=False)} == {"recv->compute"}
    # phase order: two computes of consecutive items on unrelated streams
    log = [_submit("a", "compute", 0, slot=0), _submit("b", "compute", 1, slot=1)]
    assert {v.rule for v in find_violations(log)} == {"phase-order"}
