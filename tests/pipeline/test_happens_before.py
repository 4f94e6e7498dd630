"""The recording backend's op log and the happens-before checker."""

from __future__ import annotations

import pytest

from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import RecordingBackend
from afd_mrv2.devices.recording import Op
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.plugins import plugins_for
from afd_mrv2.testing.happens_before import HappensBeforeError, check_happens_before, find_violations
from afd_mrv2.work import Slot, Work
from tests.connectors import RecordingConnector, grid, matmul_compute


class DropsSlotReuseEdge(Executor):
    """TEST-ONLY planted bug: a schedule that reuses a slot without waiting for its send.

    Both the host wait and the device-side wait on ``send_done`` are dropped.
    """

    def _wait_slot_free(self, slot: Slot, *, deadline: float | None = None) -> bool:
        self._in_flight.pop(slot.index, None)
        return True

    def _issue(self, work: Work) -> None:
        events = work.slot.events
        recv, compute, send = self.streams["recv"], self.streams["compute"], self.streams["send"]
        self._submit_phase("recv", recv, work)
        recv.record(events.recv_done)
        compute.wait(events.recv_done)
        self._submit_phase("compute", compute, work)
        compute.record(events.compute_done)
        send.wait(events.compute_done)
        self._submit_phase("send", send, work)
        send.record(events.send_done)


def run(executor_type: type[Executor], *, enabled: bool, depth: int) -> tuple[RecordingBackend, RecordingConnector]:
    backend = RecordingBackend()
    connector = RecordingConnector()
    executor = executor_type(
        plugins_for(connector), backend, MultistreamConfig(enabled=enabled, depth=depth), compute=matmul_compute()
    )
    with executor:
        executor.run(grid(3, 2, 16))
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


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_planted_bug_dropping_the_slot_reuse_edge_is_caught(depth: int) -> None:
    backend, connector = run(DropsSlotReuseEdge, enabled=True, depth=depth)
    assert len(connector.outputs) == 96  # program order still gives the right numbers here...
    violations = find_violations(backend.log)
    assert violations and {v.rule for v in violations} == {"send->slot-reuse"}  # ...but a device could race
    assert len(violations) == 96 - depth  # every slot reuse is unguarded
    with pytest.raises(HappensBeforeError, match=r"recv of \(layer=0 stage=0 seq=\d+\) may reuse slot \d before send"):
        check_happens_before(backend.log)


def test_pipelined_log_has_cross_stream_waits_serialized_has_none() -> None:
    piped, _ = run(Executor, enabled=True, depth=2)
    serial, _ = run(Executor, enabled=False, depth=2)
    assert {op.stream for op in piped.log if op.kind == "submit"} == {"recv", "compute", "send"}
    assert any(op.kind == "wait" for op in piped.log)
    assert {op.stream for op in serial.log if op.kind == "submit"} == {"serial"}
    assert not any(op.kind == "wait" for op in serial.log)


def _submit(stream: str, name: str, seq: int, slot: int = 0) -> Op:
    return Op("submit", stream, name=name, item=WorkItem(0, 0, seq), slot=slot)


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
