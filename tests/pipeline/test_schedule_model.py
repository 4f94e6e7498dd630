"""The analytic pipeline model and ``depth: "auto"``."""

from __future__ import annotations

import json
import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_mrv2.cli import main
from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import HostBackend, RecordingBackend
from afd_mrv2.pipeline import Executor
from afd_mrv2.pipeline.metrics import flow_shop_lower_bound
from afd_mrv2.pipeline.schedule_model import (
    SERIALIZED,
    PhaseTimes,
    choose_buffers,
    choose_depth,
    median_phase_times,
    predict_makespan,
    steady_period,
)
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import plugins_for
from tests.connectors import RecordingConnector, grid, run_pipelined_on_threads
from tests.support.happens_before import check_happens_before


def test_closed_forms_for_balanced_phases() -> None:
    t = PhaseTimes(1, 1, 1)
    assert predict_makespan(t, 32, 1) == 65  # one input and one output buffer: period 2
    assert predict_makespan(t, 32, 2) == 34  # two of each: all three phases busy, N + 2
    assert predict_makespan(t, 32, 3) == predict_makespan(t, 32, 8) == 34
    assert predict_makespan(t, 32, 2, depth_out=1) == predict_makespan(t, 32, 1, depth_out=2) == 65
    assert predict_makespan(t, 32, 3, streams=SERIALIZED) == 96


def test_buffer_reuse_period_is_the_closed_form() -> None:
    """period = max(r, c, s, (r + c) / depth_in, (c + s) / depth_out)."""
    for r, c, s in [(3, 1, 3), (1, 3, 1), (2, 1, 0.5), (1, 1, 1), (5, 2, 1)]:
        t = PhaseTimes(r, c, s)
        for depth_in in (1, 2, 3, 4):
            for depth_out in (1, 2, 3, 4):
                n = 400

                def made(items: int, t: PhaseTimes = t, depth_in: int = depth_in, depth_out: int = depth_out) -> float:
                    return predict_makespan(t, items, depth_in, depth_out=depth_out)

                measured_period = (made(n) - made(n // 2)) / (n - n // 2)
                assert measured_period == pytest.approx(steady_period(t, depth_in, depth_out), rel=1e-9)


def test_choose_depth() -> None:
    assert choose_depth(PhaseTimes(1, 1, 1)) == 2  # two input + two output buffers overlap all three
    assert choose_depth(PhaseTimes(3, 1, 3)) == 2  # comm-bound: (3 + 1) / 2 < 3
    assert choose_depth(PhaseTimes(1, 3, 1)) == 2  # compute-bound: (1 + 3) / 2 < 3
    assert choose_depth(PhaseTimes(2, 1, 0.5)) == 2
    assert choose_depth(PhaseTimes(1, 0, 0)) == 1
    assert choose_depth(PhaseTimes(1, 1, 1), max_depth=1) == 1


def test_choose_buffers_takes_the_fewest_bytes_within_tolerance() -> None:
    def pick(t: PhaseTimes, **kw: int) -> tuple[int, int]:
        choice = choose_buffers(t, **kw)
        return (choice.depth_in, choice.depth_out)

    assert pick(PhaseTimes(1, 1, 1)) == (2, 2)
    assert pick(PhaseTimes(3, 1, 1)) == (2, 1)  # recv-bound: (1 + 1) / 1 <= 3, one output buffer suffices
    assert pick(PhaseTimes(1, 1, 3)) == (1, 2)  # send-bound: one input buffer suffices
    assert pick(PhaseTimes(1, 0, 0)) == (1, 1)
    # Within tolerance, bytes decide: (1 in, 2 out) and (2 in, 1 out) are equally fast here.
    slack = PhaseTimes(1, 0.01, 1)
    assert pick(slack, bytes_in=1, bytes_out=1) in {(1, 2), (2, 1), (1, 1)}
    assert pick(PhaseTimes(4, 4, 0.5), bytes_in=100, bytes_out=1) == (2, 2)  # (4 + 4) / 2 = 4, (4 + 0.5) / 1 > 4
    choice = choose_buffers(PhaseTimes(1, 1, 1))
    assert choice.makespan <= choice.fastest * 1.05


def test_choose_depth_counts_the_variance_of_measured_samples() -> None:
    """Medians say two input buffers suffice; one recv spike in four stalls a 2-buffer cycle."""
    samples = [PhaseTimes(1, 6, 1)] * 3 + [PhaseTimes(9, 6, 1)]
    assert choose_depth(median_phase_times([t.as_tuple() for t in samples])) == 2
    assert choose_depth(samples) == 3
    medians = choose_buffers(median_phase_times([t.as_tuple() for t in samples]))
    measured = choose_buffers(samples)
    assert (medians.depth_in, measured.depth_in) == (2, 3)
    with pytest.raises(ValueError, match="no phase-time samples"):
        choose_depth([])


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="items and buffer counts must be >= 1"):
        predict_makespan(PhaseTimes(1, 1, 1), 0, 1)
    with pytest.raises(ValueError, match="got 2 phase times for 3 items"):
        predict_makespan([PhaseTimes(1, 1, 1)] * 2, 3, 1)
    with pytest.raises(ValueError, match="no phase-time samples"):
        median_phase_times([])
    assert median_phase_times([(1, 2, 3), (3, 4, 5)]) == PhaseTimes(2, 3, 4)


phase = st.floats(0.0, 10.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(phase, phase, phase), min_size=1, max_size=20), st.integers(1, 8))
def test_model_properties(times: list[tuple[float, float, float]], depth: int) -> None:
    per_item = [PhaseTimes(*t) for t in times]
    n = len(per_item)
    made = predict_makespan(per_item, n, depth)
    assert made <= predict_makespan(per_item, n, depth, streams=SERIALIZED) + 1e-9
    assert made >= flow_shop_lower_bound(times) - 1e-9
    assert predict_makespan(per_item, n, depth + 1) <= made + 1e-9  # more buffers never hurt
    assert predict_makespan(per_item, n, depth, depth_out=depth + 1) <= made + 1e-9
    assert predict_makespan(per_item, n, depth + 1, depth_out=depth) <= made + 1e-9


def test_model_predicts_a_host_backend_run() -> None:
    """Sleep-only phases (robust on a loaded machine): prediction within 25 %."""
    connector = RecordingConnector(sleep_s={"recv": 0.012, "compute": 0.004, "send": 0.012})
    trace = Trace()
    run_pipelined_on_threads(connector, grid(1, 1, 12), depth=2, trace=trace)
    measured = trace.metrics().makespan_ns / 1e9
    predicted = predict_makespan(PhaseTimes(0.012, 0.004, 0.012), 12, 2)
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


def test_auto_depth_decides_once_and_keeps_the_schedule_proven(caplog: pytest.LogCaptureFixture) -> None:
    backend = RecordingBackend()  # logical clock: every phase lasts the same -> balanced -> 2 in, 2 out
    connector = RecordingConnector()
    config = MultistreamConfig(enabled=True, depth="auto", auto_window=5)
    executor = Executor(plugins_for(connector), backend, config, compute=lambda i, x: x)
    with caplog.at_level(logging.INFO, logger="afd_mrv2"), executor:
        assert executor.depth == 8 and executor.depth_choice is None
        executor.run(grid(3, 2, 6))
    choice = executor.depth_choice
    assert choice is not None and (choice.depth_in, choice.depth_out) == (2, 2) and choice.window == 5
    assert (executor.depth_in, executor.depth_out) == (2, 2)
    messages = [r.getMessage() for r in caplog.records if "depth auto" in r.getMessage()]
    assert messages == [
        "afd-mrv2 executor: depth auto -> 2in/2out buffers "
        "(median over 5 items: recv 0.001 ms, compute 0.001 ms, send 0.001 ms)"
    ]
    assert len(connector.outputs) == 36
    slots_after = {c.slots for c in connector.calls if c.item.seq >= 10}
    assert slots_after <= {(0, 0), (1, 1)}
    check_happens_before(backend.log)
    check_happens_before(backend.log, host_edges=False)
    # the slots auto depth stopped using gave their buffers back; the kept ones hold theirs
    retired = executor.inputs[2:] + executor.outputs[2:]
    assert len(retired) == 12 and all(slot.state is None for slot in retired)
    held = executor.buffer_bytes()
    assert all(n > 0 for n in held.inputs[:2])  # (the outputs are the inputs here: compute returns them)
    assert held.inputs[2:] == held.outputs[2:] == (0,) * 6


def test_auto_depth_on_threads_picks_the_model_depth() -> None:
    connector = RecordingConnector(sleep_s={"recv": 0.006, "compute": 0.002, "send": 0.006})
    config = MultistreamConfig(enabled=True, depth="auto", auto_window=4)
    with Executor(plugins_for(connector), HostBackend(), config, compute=lambda i, x: x) as executor:
        for item in grid(1, 1, 20):
            executor.submit(item)
            time.sleep(0.001)
        executor.drain()
    choice = executor.depth_choice
    assert choice is not None and (choice.depth_in, choice.depth_out) == (2, 2)  # comm-bound: (6 + 2) / 2 < 6
    assert len(connector.outputs) == 20


def test_bench_json(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    chart = tmp_path / "bench.png"
    args = [
        "bench",
        "--scenario",
        "balanced",
        "--items",
        "8",
        "--repeats",
        "1",
        "--depths",
        "1",
        "3",
        "--json",
        "--chart",
        str(chart),
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    modes = [(c["mode"], c["depth"]) for c in result["cells"]]
    assert modes[:3] == [("serialized", 1), ("pipelined", 1), ("pipelined", 3)] and modes[3][0] == "auto"
    # the model's only input: the per-item phase times measured in the serialized run
    per_item = [PhaseTimes(*t) for t in result["cells"][0]["phase_ms"]]
    assert len(per_item) == 8
    for cell in result["cells"]:
        assert 0 < cell["efficiency"] <= 1.05 and cell["makespan_ms"] > 0
        assert len(cell["phase_ms"]) == 8
        streams = SERIALIZED if cell["mode"] == "serialized" else None
        predicted = predict_makespan(
            per_item, len(per_item), cell["depth_in"], depth_out=cell["depth_out"], streams=streams
        )
        measured = cell["makespan_ms"]
        assert cell["predicted_ms"] == pytest.approx(predicted, rel=1e-12, abs=0)
        assert cell["model_error"] == pytest.approx(abs(predicted - measured) / measured, rel=1e-12, abs=0)
        assert cell["model_depth"] == choose_depth(per_item)
    serial = result["cells"][0]
    # one stream: the model adds the phases up, and the measured run can only add gaps between them
    assert serial["predicted_ms"] == pytest.approx(sum(map(sum, serial["phase_ms"])), rel=1e-9)
    assert serial["makespan_ms"] >= serial["predicted_ms"] * (1 - 1e-9)
    assert result["summary"]["scenarios"]["balanced"]["model_depth"] in (2, 3, 4)
    assert result["chart"] == str(chart) and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
