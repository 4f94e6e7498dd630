#!/usr/bin/env python3
"""What expert replicas cost without faults: two serve sides measured in one run.

    .venv-vllm/bin/python scripts/bench_replicas.py MODEL [--compare replicas] [--ffn 2] [--clients 32]
        [--tokens 32] [--requests 32] [--rounds 3] [--json OUT] [--logs DIR] [-- ENGINE ARGS]

``--compare replicas`` (the one comparison): ``afd-mrv2 serve --attention 1 --ffn F`` (R = 1) against the
same with ``--expert-replicas 2`` (R = 2; a healthy deployment routes every expert to its primary, so the
traffic is the same and the difference is what the replicas themselves cost: the FFN ranks' memory and the
routing).  The per-pair transport against one group of every rank (``--compare transport``) was removed
with that transport; docs/benchmarks-vllm.md keeps its figures.

Both sides run Model Runner V2 with one micro-batch (``--ubatches 1``: every MoE layer one blocking round
trip; on CPU through the test-only triton stand-in), start together, then alternate rounds with the other
side's processes stopped (SIGSTOP, checked), as scripts/bench_serve.py does (its round and summary code).
Prints per round tok/s and forward ms, per side the medians, the ratio of the second side to the first,
and each FFN rank's routed-expert bytes held and read, and its peak RSS (from its ``done`` report).
Exit 0 after a run, 1 when a server or request failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench_serve import (
    ENGINE_ARGS,
    SERVE_ENV,
    STOP_GRACE_S,
    Side,
    _environment,
    measure_round,
    side_summary,
)
from serving import (
    ServeServer,
    ServeTopology,
    body,
    check_model,
    check_vllm,
    guarded,
    load_average,
    prompts,
    write_json,
)

from afd_mrv2.ports import free_port_block
from afd_mrv2.table import format_table

PROG = "bench_replicas"
COMPARISONS = {
    # name -> ((side name, extra serve flags) for the base side, then for the compared side)
    "replicas": (("R1", ()), ("R2", ("--expert-replicas", "2"))),
}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    head, engine = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, ENGINE_ARGS)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("model", help="a checkpoint folder (afd-mrv2 make-model DIR --arch mixtral)")
    parser.add_argument(
        "--compare", choices=sorted(COMPARISONS), default="replicas", help="what to compare (default %(default)s)"
    )
    parser.add_argument("--ffn", type=int, default=2, metavar="F", help="FFN ranks (default 2)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request (default 32)")
    parser.add_argument("--requests", type=int, default=32, help="requests per round (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side (default 3)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    parser.add_argument(
        "--logs", default="out/bench-replicas", help="folder for the servers' logs (default %(default)s)"
    )
    args = parser.parse_args(head)
    for name in ("ffn", "clients", "tokens", "requests", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args, engine


def run(args: argparse.Namespace, engine_args: list[str]) -> dict[str, Any]:
    model = check_model(args.model)
    check_vllm()
    specs = COMPARISONS[args.compare]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    payloads = [body(model, p, args.tokens) for p in prompts(args.requests)]
    env = {**_environment(), **SERVE_ENV}
    names = [name for name, _ in specs]
    topology = ServeTopology(1, args.ffn, ubatches=1, stop_grace=STOP_GRACE_S)
    print(
        f"{PROG}: {model}, {args.compare}: {names[0]} vs {names[1]}, serve 1A{args.ffn}F --ubatches 1, "
        f"{args.clients} clients, {args.requests} requests x {args.tokens} tokens per round, {args.rounds} rounds "
        f"per side (alternating), greedy, ignore_eos\nengine args: {' '.join(engine_args)}",
        flush=True,
    )
    base = free_port_block(2 * topology.ports())
    sides: dict[str, Side] = {}
    started: list[ServeServer] = []
    load_start = load_average()
    try:
        for i, (name, flags) in enumerate(specs):
            side_topology = ServeTopology(1, args.ffn, ubatches=1, stop_grace=STOP_GRACE_S, flags=flags)
            server = ServeServer(
                model,
                base + i * topology.ports(),
                logs / f"{name}.log",
                side_topology,
                engine_args,
                env=env,
            )
            started.append(server)
            sides[name] = Side(name, server)
        for side in sides.values():
            side.ready_s = side.server.wait_ready()
            side.ready()
        print("ready: " + ", ".join(f"{n} after {s.ready_s:.0f} s" for n, s in sides.items()), flush=True)
        for name in names:  # one unmeasured round each
            measure_round(sides, name, payloads, args.clients)
        rounds: list[dict[str, Any]] = []
        for i in range(args.rounds):
            for name in names:
                r = measure_round(sides, name, payloads, args.clients)
                rounds.append({"round": i + 1, **r})
                forward = f", forward median {statistics.median(r['forward_ms']):.2f} ms" if r.get("forward_ms") else ""
                print(
                    f"  round {i + 1} {name}: {r['tokens_per_s']:.1f} tok/s in {r['wall_s']:.2f} s{forward}", flush=True
                )
        exits = {}
        for name in names:
            sides[name].settle()
            exits[name] = sides[name].server.stop()
        reports = {name: {d.rank: d.report for d in sides[name].server.ffn_reports()} for name in names}
    finally:
        for server in started:
            server.stop()
    summary = {name: side_summary(sides[name], rounds, 1) for name in names}
    first, second = (summary[n] for n in names)
    memory = {
        name: {
            str(rank): {
                "held_bytes": report.get("routed_expert_bytes"),
                "read_bytes": ((report.get("memory") or {}).get("read_bytes") or {}).get("routed_experts"),
                "peak_rss_bytes": (report.get("memory") or {}).get("peak_rss_bytes"),
            }
            for rank, report in sorted(reports[name].items())
        }
        for name in names
    }
    return {
        "model": str(model),
        "compare": args.compare,
        "sides": names,
        "engine_args": engine_args,
        "rounds": rounds,
        "summary": summary,
        "ratios": {
            f"{names[1]}/{names[0]} tok_s": second["median_tok_s"] / first["median_tok_s"],
            f"{names[1]}/{names[0]} forward_ms": (
                second["median_forward_ms"] / first["median_forward_ms"]
                if second.get("median_forward_ms") and first.get("median_forward_ms")
                else None
            ),
        },
        "expert_memory": memory,
        "serve_exit": exits,
        "load_average": {"start": load_start, "end": load_average()},
    }


def report(result: dict[str, Any]) -> None:
    names = result["sides"]
    rows = [
        [
            name,
            f"{result['summary'][name]['median_tok_s']:.1f}",
            f"{result['summary'][name].get('median_forward_ms') or float('nan'):.2f}",
            ", ".join(f"{t:.1f}" for t in result["summary"][name]["tok_s"]),
        ]
        for name in names
    ]
    print(format_table(["side", "median tok/s", "median forward ms", "rounds tok/s"], rows))
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.3f}" if value is not None else f"{key}: n/a")
    for name, ranks in result["expert_memory"].items():
        for rank, m in ranks.items():
            shown = {k: "n/a" if v is None else f"{v:,}" for k, v in m.items()}
            print(
                f"{name} FFN rank {rank}: routed-expert bytes held {shown['held_bytes']}, read {shown['read_bytes']}; "
                f"peak RSS {shown['peak_rss_bytes']} B"
            )
    print(f"load average start {result['load_average']['start']}, end {result['load_average']['end']}")


def main(argv: list[str] | None = None) -> int:
    def body_() -> int:
        args, engine = parse_args(sys.argv[1:] if argv is None else argv)
        result = run(args, engine)
        report(result)
        if args.json:
            write_json(args.json, result)
        print(json.dumps(result["ratios"]))
        return 0

    return guarded(PROG, body_)


if __name__ == "__main__":
    sys.exit(main())
