"""The ``afd-mrv2 bench`` grid: scenarios x depth x schedule on the simulated link.

Every cell runs the same items through the simulated-link connector (recv and send
are sleeps of the scenario's transfer times, compute is a calibrated matmul on one
thread) and reports makespan, flow-shop lower bound, efficiency, hidden
communication and speedup over the serialized run of the same scenario, measured
in the same process.  Each cell also carries the analytic model's prediction,
made from the per-item phase times measured in the scenario's SERIALIZED run
(never from the run it predicts), so the model is checked as it is used: phase
times from a serialized run in, the pipelined makespan out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from afd_mrv2.bench.overlap import ModeResult, calibrated_compute, run_mode
from afd_mrv2.pipeline.metrics import stage_times
from afd_mrv2.pipeline.schedule_model import (
    SERIALIZED,
    PhaseTimes,
    choose_buffers,
    choose_depth,
    predict_makespan,
)
from afd_mrv2.reference.buffer_report import counts_label


@dataclass(frozen=True)
class Scenario:
    name: str
    recv_ms: float
    compute_ms: float
    send_ms: float


SCENARIOS = (
    Scenario("comm-bound", 6.0, 2.0, 6.0),
    Scenario("compute-bound", 2.0, 6.0, 2.0),
    Scenario("balanced", 4.0, 4.0, 4.0),
    Scenario("unequal", 6.0, 3.0, 1.5),
)


@dataclass(frozen=True)
class Cell:
    scenario: str
    mode: str  # "serialized" | "pipelined" | "auto"
    depth: int  # the larger of depth_in and depth_out
    makespan_ms: float
    lower_bound_ms: float
    efficiency: float
    hidden_comm_fraction: float
    speedup: float
    predicted_ms: float
    model_error: float  # |predicted - measured| / measured
    model_depth: int  # the depth the model chooses from the serialized run's phase times
    phase_ms: tuple[tuple[float, float, float], ...]  # measured (recv, compute, send) per item, issue order
    decided: bool = True  # for "auto": whether it made its choice during the run
    depth_in: int = 0  # input buffers the cell ran with (for "auto": the chosen count)
    depth_out: int = 0  # output buffers
    buffers: dict[str, Any] = field(default_factory=dict)  # buffer_block: counts and bytes measured
    model_buffers: tuple[int, int] = (0, 0)  # the (in, out) the model chooses from the serialized phase times

    @property
    def label(self) -> str:
        """``2in/2out``: the cell's buffer counts."""
        return counts_label(self.depth_in, self.depth_out)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _phase_ms(result: ModeResult) -> tuple[tuple[float, float, float], ...]:
    return tuple((r / 1e6, c / 1e6, s / 1e6) for r, c, s in stage_times(result.trace.spans))


def _cell(scenario: Scenario, mode: str, result: ModeResult, serialized: ModeResult) -> Cell:
    trace = result.trace
    metrics = trace.metrics()
    phase_ms = _phase_ms(result)
    # The model's inputs: the per-item phase times of the serialized run only.
    per_item = [PhaseTimes(*t) for t in _phase_ms(serialized)]
    items = metrics.items
    serialized_ms = serialized.trace.metrics().makespan_ns / 1e6
    depth_in, depth_out = result.depth_in, result.depth_out
    # The model replays the schedule with the cell's own (depth_in, depth_out).
    # "auto" runs its window with more buffers, then the chosen counts: never
    # slower than the chosen counts throughout, which is what the model predicts.
    predicted = predict_makespan(
        per_item, items, depth_in, depth_out=depth_out, streams=SERIALIZED if mode == "serialized" else None
    )
    measured = metrics.makespan_ns / 1e6
    slot_in = max(result.buffers["input_bytes"], default=0)
    slot_out = max(result.buffers["output_bytes"], default=0)
    model_pick = choose_buffers(per_item, bytes_in=slot_in, bytes_out=slot_out)
    return Cell(
        scenario=scenario.name,
        mode=mode,
        depth=result.depth,
        makespan_ms=measured,
        lower_bound_ms=metrics.lower_bound_ns / 1e6,
        efficiency=metrics.efficiency,
        hidden_comm_fraction=metrics.hidden_comm_fraction,
        speedup=serialized_ms / measured,
        predicted_ms=predicted,
        model_error=abs(predicted - measured) / measured,
        model_depth=choose_depth(per_item),
        phase_ms=phase_ms,
        decided=mode != "auto" or result.window > 0,
        depth_in=depth_in,
        depth_out=depth_out,
        buffers=result.buffers,
        model_buffers=(model_pick.depth_in, model_pick.depth_out),
    )


def run_grid(
    *,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
    depths: tuple[int, ...] = (1, 2, 3, 4),
    buffers: tuple[tuple[int, int], ...] = (),
    items: int = 24,
    auto_window: int | None = None,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[Cell]:
    """Run every scenario: serialized, pipelined at each depth (d in + d out) and
    each (in, out) pair of ``buffers``, and ``depth: auto``.

    Each mode runs ``repeats`` times, interleaved with the other modes so that a
    burst of machine load hits all of them alike; the run with the median makespan
    is reported.
    """
    window = auto_window or max(2, min(6, items // 4))
    pairs = [(d, d) for d in depths] + [p for p in buffers if p not in [(d, d) for d in depths]]
    modes: list[tuple[str, int | str, int | None]] = [
        ("serialized", 1, None),
        *(("pipelined", d_in, d_out) for d_in, d_out in pairs),
        ("auto", "auto", None),
    ]
    cells: list[Cell] = []
    for scenario in scenarios:
        compute = calibrated_compute(scenario.compute_ms / 1e3)
        runs: dict[int, list[ModeResult]] = {i: [] for i in range(len(modes))}
        for repeat in range(repeats):
            for i, (mode, depth, depth_out) in enumerate(modes):
                if progress:
                    counts = depth if depth_out is None else counts_label(int(depth), depth_out)
                    progress(f"{scenario.name}: {mode} {counts} (run {repeat + 1}/{repeats})")
                runs[i].append(
                    run_mode(
                        items=items,
                        depth=depth,
                        depth_out=depth_out,
                        pipelined=mode != "serialized",
                        compute=compute,
                        recv_s=scenario.recv_ms / 1e3,
                        send_s=scenario.send_ms / 1e3,
                        auto_window=window,
                    )
                )
        chosen = [sorted(rs, key=lambda r: r.trace.metrics().makespan_ns)[len(rs) // 2] for rs in runs.values()]
        cells += [_cell(scenario, mode, result, chosen[0]) for (mode, _, _), result in zip(modes, chosen, strict=True)]
    return cells
