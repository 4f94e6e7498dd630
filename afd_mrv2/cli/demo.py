"""``afd-mrv2 demo``: serialized vs pipelined on the simulated link, side by side."""

from __future__ import annotations

import argparse
import json

from afd_mrv2.cli import add_buffer_options, add_command
from afd_mrv2.reference.buffer_report import buffers_cell
from afd_mrv2.table import format_table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        sub,
        "demo",
        "run the shared pipeline on the simulated link: serialized vs pipelined",
        (
            "Runs the same work items through the simulated-link connector serialized and "
            "pipelined (recv and send each sleep --phase-ms, compute does about --phase-ms of "
            "matmul on one thread) and prints makespan, flow-shop lower bound, efficiency, "
            "hidden-communication fraction and speedup, measured in one run."
        ),
    )
    parser.add_argument("--items", type=int, default=32, help="work items per run (default 32)")
    add_buffer_options(parser, default="2 3", what="run", retired=("--depth",))
    parser.add_argument("--phase-ms", type=float, default=5.0, help="time of each phase in ms (default 5)")
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome trace JSON (Perfetto) of all runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from afd_mrv2.bench.overlap import compare
    from afd_mrv2.pipeline.trace import write_chrome_trace

    depths = [2, 3] if args.depths is None and not args.buffers else list(args.depths or [])
    buffers = tuple((i, o) for i, o in args.buffers)
    if args.items < 1 or args.phase_ms <= 0 or any(not 1 <= d <= 8 for d in depths + [n for p in buffers for n in p]):
        raise SystemExit("afd-mrv2 demo: --items must be >= 1, --phase-ms > 0, each --depths / --buffers count in 1..8")
    rows, results = compare(items=args.items, depths=tuple(depths), buffers=buffers, phase_s=args.phase_ms / 1e3)
    trace_path = None
    if args.trace:
        trace_path = str(write_chrome_trace(args.trace, [r.trace for r in results], distinct_pids=True))
    if args.json:
        print(json.dumps({"items": args.items, "phase_ms": args.phase_ms, "modes": rows, "trace": trace_path}))
        return 0
    headers = ["mode", "buffers (in+out)", "makespan ms", "bound ms", "efficiency", "hidden comm", "speedup"]
    headers.append("max |diff|")
    keys = ["makespan_ms", "lower_bound_ms", "efficiency", "hidden_comm_fraction", "speedup", "max_abs_diff"]
    print(f"simulated link, {args.items} work items, recv = compute = send = {args.phase_ms:g} ms (host backend)")
    print(format_table(headers, [[row["mode"], buffers_cell(row["buffers"]), *(row[k] for k in keys)] for row in rows]))
    print("bound = flow-shop lower bound; efficiency = bound / makespan; speedup = serialized wall / this wall;")
    print("buffers = input + output buffers / the bytes they held (tensor storages, measured after the run)")
    if trace_path:
        print(f"trace: {trace_path} (open in https://ui.perfetto.dev)")
    return 0
