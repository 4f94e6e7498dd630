"""Phase traces: spans collected by the executor, exported as Chrome trace JSON.

The JSON opens in Perfetto (ui.perfetto.dev) and chrome://tracing: one process per
rank (``pid``), one lane per stream (``tid``), one complete event (``ph: "X"``) per
phase, with the work identity in ``args``.  Timestamps are ``time.perf_counter_ns``
(CLOCK_MONOTONIC on Linux), so traces of processes on one machine line up when
merged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from afd_mrv2.devices.base import Span
from afd_mrv2.pipeline.metrics import PipelineMetrics, compute_metrics


class Trace:
    """The spans of one executor (one rank, one role)."""

    def __init__(self, *, rank: int = 0, role: str = "", label: str = "") -> None:
        self.rank = rank
        self.role = role
        self.label = label
        self.spans: list[Span] = []

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def metrics(self) -> PipelineMetrics:
        return compute_metrics(self.spans)

    @property
    def process_name(self) -> str:
        name = f"{self.role} rank {self.rank}" if self.role else f"rank {self.rank}"
        return f"{name} ({self.label})" if self.label else name

    def chrome_events(self, *, pid: int | None = None) -> list[dict[str, Any]]:
        """This trace's Chrome trace events (metadata first)."""
        pid = self.rank if pid is None else pid
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": self.process_name}}
        ]
        lanes: dict[int, str] = {}
        for span in self.spans:
            lanes.setdefault(span.stream_id, span.stream_name)
            args: dict[str, str | int] = {"stream": span.stream_name}
            if span.item is not None:
                args.update(layer=span.item.layer_idx, stage=span.item.stage_idx, seq=span.item.seq)
            if span.slots is not None:
                args["in_slot"], args["out_slot"] = span.slots
            events.append(
                {
                    "name": span.name,
                    "cat": span.name,
                    "ph": "X",
                    "ts": span.start_ns / 1e3,
                    "dur": max(span.duration_ns, 0) / 1e3,
                    "pid": pid,
                    "tid": span.stream_id,
                    "args": args,
                }
            )
        for tid, name in lanes.items():
            events.insert(1, {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        return events


def chrome_trace(traces: Iterable[Trace], *, distinct_pids: bool = False) -> dict[str, Any]:
    """Merge traces into one Chrome trace document.

    ``distinct_pids`` numbers processes 0, 1, ... instead of by rank (use it when
    merging several executors of one rank, e.g. a serialized and a pipelined run).
    """
    events: list[dict[str, Any]] = []
    for i, trace in enumerate(traces):
        events += trace.chrome_events(pid=i if distinct_pids else None)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str], traces: Iterable[Trace], *, distinct_pids: bool = False) -> Path:
    """Write the merged Chrome trace JSON to ``path`` and return it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(chrome_trace(traces, distinct_pids=distinct_pids)))
    return target
