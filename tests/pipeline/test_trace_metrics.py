"""Trace export and overlap metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_mrv2.devices.base import Span
from afd_mrv2.pipeline import WorkItem
from afd_mrv2.pipeline.metrics import busy_ns, compute_metrics, flow_shop_lower_bound, hidden_comm_fraction
from afd_mrv2.pipeline.trace import Trace, chrome_trace, write_chrome_trace
from tests.connectors import RecordingConnector, grid, run_pipelined_on_threads


def span(name: str, stream: str, start: int, end: int, seq: int = 0) -> Span:
    return Span(name, stream, hash(stream) % 1000, WorkItem(0, 0, seq), (0, 0), start, end)


def test_flow_shop_lower_bound() -> None:
    assert flow_shop_lower_bound([]) == 0
    assert flow_shop_lower_bound([[1, 1, 1]] * 10) == 12  # N*T + head + tail
    # recv: 3 + 0 + min(3, 7) = 6; compute: 5 + min(1, 2) + min(1, 4) = 7;
    # send: 5 + min(1+2, 2+3) + 0 = 8  -> send dominates
    assert flow_shop_lower_bound([[1, 2, 1], [2, 3, 4]]) == 8
    # compute-heavy: compute 10 + min head 1 + min tail 1 = 12
    assert flow_shop_lower_bound([[1, 5, 1], [1, 5, 1]]) == 12
    assert flow_shop_lower_bound([[5, 1, 1], [5, 1, 1]]) == 12  # 10 of recv + min tail 2


def test_hidden_fraction_and_busy_time() -> None:
    spans = [
        span("recv", "r", 0, 10),
        span("compute", "c", 5, 15),
        span("compute", "c", 14, 20),
        span("send", "s", 15, 25),
    ]
    # recv overlaps compute on [5, 10] (5 of 10); send on [15, 20] (5 of 10)
    assert hidden_comm_fraction(spans) == pytest.approx(0.5)
    assert busy_ns(spans) == {"r": 10, "c": 15, "s": 10}
    metrics = compute_metrics(spans)
    assert metrics.makespan_ns == 25


def test_chrome_trace_has_one_lane_per_stream_and_the_work_identity() -> None:
    trace = Trace(rank=3, role="ffn", label="pipelined")
    trace.add(Span("recv", "recv", 11, WorkItem(1, 0, 4), (2, 1), 1000, 3000))
    trace.add(Span("compute", "compute", 12, WorkItem(1, 0, 4), (2, 1), 3000, 6000))
    doc = chrome_trace([trace])
    events = doc["traceEvents"]
    assert events[0] == {"name": "process_name", "ph": "M", "pid": 3, "args": {"name": "ffn rank 3 (pipelined)"}}
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {11: "recv", 12: "compute"}
    recv = next(e for e in events if e["ph"] == "X" and e["name"] == "recv")
    assert recv["ts"] == 1.0 and recv["dur"] == 2.0 and recv["pid"] == 3 and recv["tid"] == 11
    assert recv["args"] == {"stream": "recv", "layer": 1, "stage": 0, "seq": 4, "in_slot": 2, "out_slot": 1}


def test_pipelined_trace_shows_overlap_on_distinct_streams(tmp_path: Path) -> None:
    trace = Trace(role="ffn")
    connector = RecordingConnector(sleep_s={"recv": 0.01, "compute": 0.01, "send": 0.01})
    run_pipelined_on_threads(connector, grid(2, 2, 2), depth=3, trace=trace)
    path = write_chrome_trace(tmp_path / "t.json", [trace])
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * 8
    overlapping = {
        (a["name"], b["name"])
        for a in events
        for b in events
        if a["tid"] != b["tid"]
        and a["args"]["seq"] != b["args"]["seq"]
        and a["ts"] < b["ts"] + b["dur"]
        and b["ts"] < a["ts"] + a["dur"]
    }
    assert {("recv", "compute"), ("compute", "send"), ("recv", "send")} <= overlapping
    metrics = trace.metrics()
    assert metrics.items == 8
    assert 0.3 < metrics.hidden_comm_fraction <= 1.0
    assert 0.5 < metrics.efficiency <= 1.05
