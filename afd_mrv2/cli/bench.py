"""``afd-mrv2 bench``: measured overlap vs the analytic limit, and the depth to run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from afd_mrv2.cli import add_buffer_options, add_command
from afd_mrv2.reference.buffer_report import buffers_cell, counts_label
from afd_mrv2.table import format_table

if TYPE_CHECKING:
    from afd_mrv2.bench.grid import Cell

BEST_NOISE = 0.02


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from afd_mrv2.bench.grid import SCENARIOS

    parser = add_command(
        sub,
        "bench",
        "scenario grid x depth x schedule: efficiency, hidden communication, model, auto depth",
        (
            "Runs each scenario (communication-bound, compute-bound, balanced, unequal recv/send) "
            "serialized, pipelined at each depth, and with depth auto, on the simulated link; "
            "reports makespan, flow-shop bound, efficiency, hidden communication, speedup and the "
            "analytic model's prediction, and writes a PNG chart."
        ),
    )
    parser.add_argument("--scenario", nargs="+", choices=[s.name for s in SCENARIOS], help="scenarios (default: all)")
    add_buffer_options(parser, default="1 2 3 4", what="run")
    parser.add_argument("--items", type=int, default=24, help="work items per run (default 24)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported (default 3)")
    parser.add_argument("--chart", default="out/bench.png", help="PNG chart path (default out/bench.png)")
    parser.add_argument("--no-chart", action="store_true", help="do not write the chart")
    parser.add_argument(
        "--link",
        choices=["sim", "gloo"],
        default="sim",
        help="sim: the scenario grid on the simulated link (default); gloo: the depth sweep on the embedded deployment",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from afd_mrv2.bench.grid import SCENARIOS, run_grid

    depths = [1, 2, 3, 4] if args.depths is None and not args.buffers else list(args.depths or [])
    buffers = [tuple(p) for p in args.buffers]
    counts = depths + [n for p in buffers for n in p]
    if args.items < 2 or args.repeats < 1 or any(not 1 <= d <= 8 for d in counts):
        raise SystemExit("afd-mrv2 bench: --items >= 2, --repeats >= 1, each --depths / --buffers count in 1..8")
    args.depths, args.buffers = depths, buffers
    if args.link == "gloo":
        return run_gloo_sweep(args)
    torch.set_num_threads(1)
    scenarios = tuple(s for s in SCENARIOS if not args.scenario or s.name in args.scenario)

    def progress(message: str) -> None:
        print(f"\r\033[K[bench] {message}", end="", file=sys.stderr, flush=True)

    cells = run_grid(
        scenarios=scenarios,
        depths=tuple(args.depths),
        buffers=tuple(args.buffers),
        items=args.items,
        repeats=args.repeats,
        progress=progress,
    )
    print("\r\033[K", end="", file=sys.stderr, flush=True)
    chart = None if args.no_chart else str(write_chart_path(cells, args.chart))
    summary = summarize(cells)
    if args.json:
        print(json.dumps({"cells": [c.as_dict() for c in cells], "summary": summary, "chart": chart}))
        return 0
    print(_cells_table(cells))
    print("buffers = input + output buffers / the bytes they held (tensor storages, measured after the run)")
    print()
    print(f"model vs measured: median |error| {summary['median_model_error']:.1%} over {len(cells)} cells")
    for name, s in summary["scenarios"].items():
        chose = "auto chose" if s["auto_decided"] else "auto undecided, ran at"
        print(
            f"{name}: best fixed {s['best_buffers']} ({s['best_ms']:.1f} ms; fewest buffer bytes within 2% of the "
            f"fastest); model chooses {s['model_buffers']}; "
            f"{chose} {s['auto_buffers']} ({s['auto_ms']:.1f} ms, {s['auto_vs_best']:.2f}x best)"
        )
    if chart:
        print(f"chart: {chart}")
    return 0


def _cells_table(cells: Sequence[Cell]) -> str:
    """One row per (scenario, mode) cell: makespan, its bound, efficiency, hidden comm, speedup, the model."""
    headers = [
        "scenario",
        "mode",
        "buffers (in+out)",
        "makespan ms",
        "bound ms",
        "efficiency",
        "hidden comm",
        "speedup",
        "model ms",
        "model err",
    ]
    rows = [
        [
            c.scenario,
            c.mode,
            buffers_cell(c.buffers),
            c.makespan_ms,
            c.lower_bound_ms,
            c.efficiency,
            c.hidden_comm_fraction,
            c.speedup,
            c.predicted_ms,
            c.model_error,
        ]
        for c in cells
    ]
    return format_table(headers, rows)


def write_chart_path(cells: Sequence[Cell], path: str) -> Path:
    from afd_mrv2.bench.chart import write_chart

    return write_chart(cells, path)


class Summary(TypedDict):
    """What ``summarize`` returns: the model's median error, and per scenario its best, model and auto choices."""

    median_model_error: float
    scenarios: dict[str, dict[str, object]]


def summarize(cells: Sequence[Cell]) -> Summary:
    """Model error, best fixed buffer counts, and what auto chose, per scenario."""
    scenarios: dict[str, dict[str, object]] = {}
    for name in dict.fromkeys(c.scenario for c in cells):
        rows = [c for c in cells if c.scenario == name]
        # Cheapest first: fewest buffer bytes, then fewest buffers, then fewer inputs.
        piped = sorted(
            (c for c in rows if c.mode == "pipelined"),
            key=lambda c: (c.buffers["bytes"], c.depth_in + c.depth_out, c.depth_in),
        )
        auto = next(c for c in rows if c.mode == "auto")
        fastest = min(c.makespan_ms for c in piped)
        # The best fixed counts are the cheapest within timer noise (2 %) of the
        # fastest: more buffers at the same speed only cost memory.
        best = next(c for c in piped if c.makespan_ms <= fastest * (1 + BEST_NOISE))
        scenarios[name] = {
            "best_depth": best.depth,
            "best_buffers": best.label,
            "best_bytes": best.buffers["bytes"],
            "best_ms": best.makespan_ms,
            "model_depth": auto.model_depth,
            "model_buffers": counts_label(*auto.model_buffers),
            "auto_depth": auto.depth,
            "auto_buffers": auto.label,
            "auto_bytes": auto.buffers["bytes"],
            "auto_decided": auto.decided,
            "auto_ms": auto.makespan_ms,
            "auto_vs_best": auto.makespan_ms / best.makespan_ms,
            "fastest_depth": min(piped, key=lambda c: c.makespan_ms).depth,
            "fastest_buffers": min(piped, key=lambda c: c.makespan_ms).label,
        }
    return {"median_model_error": statistics.median(c.model_error for c in cells), "scenarios": scenarios}


def run_gloo_sweep(args: argparse.Namespace) -> int:
    from afd_mrv2.bench.gloo import run_gloo

    pairs = tuple((d, d) for d in args.depths if d > 1) + tuple(args.buffers)
    rows = run_gloo(pairs or ((2, 2),))
    if args.json:
        print(json.dumps({"link": "gloo", "modes": rows}))
        return 0
    for row in rows:
        row["buffers_cell"] = buffers_cell(row["buffers"])
    keys = [
        "mode",
        "buffers_cell",
        "per_layer_ms",
        "efficiency",
        "hidden_comm_fraction",
        "speedup",
        "cores_busy",
        "max_abs_diff",
    ]
    headers = [
        "mode",
        "buffers (in+out)",
        "per-layer ms",
        "efficiency",
        "hidden comm",
        "speedup",
        "cores busy",
        "max |diff|",
    ]
    print("embedded deployment on gloo (afd-mrv2 run: 2 attention + 1 FFN processes, loopback)")
    print(format_table(headers, [[row[k] for k in keys] for row in rows]))
    print("efficiency and hidden comm are the FFN ranks'; cores busy = CPU time of all ranks / wall time;")
    print(
        "buffers = input + output buffers / the largest rank's buffer bytes (tensor storages, measured after the run)"
    )
    return 0
