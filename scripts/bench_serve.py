#!/usr/bin/env python3
"""Output-token throughput of ``afd-mrv2 serve`` against plain vLLM's OpenAI server, side by side in one run.

    .venv-vllm/bin/python scripts/bench_serve.py MODEL [--clients 16] [--tokens N] [--requests R] [--rounds K]
        [--attention A --ffn F] [--depth D] [--plain-cores LIST] [--json OUT] [-- ENGINE ARGS]

Starts plain vLLM's OpenAI server and ``afd-mrv2 serve`` on the same checkpoint with the same
engine arguments (default ``--dtype float32 --max-model-len 256 --max-num-seqs 16 --seed 0``),
warms both up, then measures K rounds on each, alternating plain / serve / plain / serve ... (never
both at once), each round R greedy ``ignore_eos`` completions of N tokens from C concurrent
clients.  Reports output tokens/s per round, serve/plain per round pair and their median, the CPU
time each side's processes used per round (``cores busy``), and how many cores each side was
pinned to.  Then stops plain vLLM, stops serve with SIGTERM and prints each FFN role's
``afd-mrv2 ffn: done {...}`` report (every key it has) with its busy fraction.

Plain vLLM is pinned (``VLLM_CPU_OMP_THREADS_BIND``) to ``--plain-cores`` (default: the first core
this process may use); serve pins each role to cores of its own.  Exit 0 after a run, 1 when a
server failed or requests failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _serving import (
    ENGINE_ARGS,
    PlainServer,
    ServerError,
    ServeServer,
    ServeTopology,
    UsageError,
    body,
    check_model,
    check_vllm,
    count_cores,
    cpu_seconds,
    free_port_block,
    guarded,
    load_average,
    parse_cpu_list,
    prompts,
    role_binds,
    run_requests,
    write_json,
)

from afd_mrv2.table import format_table

PROG = "bench_serve"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    head, engine = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, ENGINE_ARGS)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("model", help="a checkpoint folder (afd-mrv2 make-model DIR --arch mixtral)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--requests", type=int, default=64, help="requests per round (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side (default 3)")
    parser.add_argument("--attention", type=int, default=1, metavar="A", help="serve's Attention ranks (default 1)")
    parser.add_argument("--ffn", type=int, default=1, metavar="F", help="serve's FFN ranks (default 1)")
    parser.add_argument("--depth", metavar="D|auto", help="serve --depth (FFN multistream depth)")
    parser.add_argument("--plain-cores", metavar="LIST", help="cores for plain vLLM, e.g. 0 or 0,1 (default: 1 core)")
    parser.add_argument(
        "--no-trace", action="store_true", help="no afd.multistream.trace on serve (no overlap figures in the report)"
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    parser.add_argument("--logs", default="out/bench-serve", help="folder for the servers' logs (default %(default)s)")
    args = parser.parse_args(head)
    for name in ("clients", "tokens", "requests", "rounds", "attention", "ffn"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    return args, list(engine)


def side_round(
    server: PlainServer | ServeServer, payloads: list[dict[str, Any]], clients: int, roles: dict[str, int]
) -> dict[str, Any]:
    """One measured round on one server: throughput, and the CPU time its process tree (and each role's) used."""
    cpu0 = cpu_seconds(server.proc.pid)
    role0 = {name: cpu_seconds(pid) for name, pid in roles.items()}
    result = run_requests(server.url, payloads, clients)
    cpu = cpu_seconds(server.proc.pid) - cpu0
    role_cpu = {name: cpu_seconds(pid) - role0[name] for name, pid in roles.items()}
    server.track()
    if result.failures:
        raise ServerError(
            f"{server.name}: {len(result.failures)} of {len(payloads)} requests failed: {result.failures[0]}"
        )
    return {
        "wall_s": result.wall_s,
        "output_tokens": result.output_tokens,
        "tokens_per_s": result.tokens_per_s,
        "cpu_s": cpu,
        "cores_busy": cpu / result.wall_s,
        "roles_cores_busy": {name: c / result.wall_s for name, c in role_cpu.items()},
    }


def _flat(report: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Small dicts (up to 4 keys) one level deep as dotted keys; other dicts and lists as compact JSON; long texts cut."""
    flat: dict[str, Any] = {}
    for key, value in report.items():
        if isinstance(value, dict) and not prefix and len(value) <= 4:
            flat.update(_flat(value, f"{key}.") if value else {key: "{}"})
        elif isinstance(value, dict | list):
            flat[prefix + key] = _short(json.dumps(value, separators=(",", ":")))
        else:
            flat[prefix + key] = _short(value) if isinstance(value, str) else value
    return flat


def _short(text: str, width: int = 70) -> str:
    """Long texts (an end reason) cut for the table; the JSON output keeps them whole."""
    return text if len(text) <= width else text[: width - 3] + "..."


def ffn_table(reports: list[dict[str, Any]], window_s: float) -> str:
    """Every key of every FFN report (a row per key, a column per FFN rank), busy fraction first."""
    flats: dict[str, dict[str, Any]] = {}
    for entry in reports:
        report = entry["report"]
        busy = float(report.get("busy_s", 0.0))
        per_item = {int(k): int(v) for k, v in (report.get("tokens_per_item") or {}).items()}
        mean = sum(k * v for k, v in per_item.items()) / max(1, sum(per_item.values()))
        flats[f"ffn {entry['rank']}"] = {
            "busy fraction (busy_s / serving window)": f"{busy / window_s:.4f}",
            "tokens per item (mean)": f"{mean:.1f}",
            **_flat(report),
        }
    keys: list[str] = []
    for flat in flats.values():
        keys += [k for k in flat if k not in keys]
    table: str = format_table(
        ["report key", *flats], [[k, *(flat.get(k, "") for flat in flats.values())] for k in keys]
    )
    return table


def run(args: argparse.Namespace, engine_args: list[str]) -> dict[str, Any]:
    model = check_model(args.model)
    check_vllm()
    available = sorted(os.sched_getaffinity(0))
    plain_cores = args.plain_cores or str(available[0])
    parse_cpu_list(plain_cores)
    afd = None if args.no_trace else {"multistream": {"trace": True}}
    topology = ServeTopology(args.attention, args.ffn, args.depth, afd)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    payloads = [body(model, p, args.tokens) for p in prompts(args.requests)]
    load_start = load_average()
    print(
        f"{PROG}: {model}, {args.clients} clients, {args.requests} requests x {args.tokens} tokens per round, "
        f"{args.rounds} rounds per side (alternating), greedy, ignore_eos\nengine args (both sides): {' '.join(engine_args)}",
        flush=True,
    )
    plain = PlainServer(model, free_port_block(1), logs / "plain.log", engine_args, plain_cores)
    serve = None
    try:
        serve = ServeServer(model, free_port_block(topology.ports()), logs / "serve.log", topology, engine_args)
        plain_ready = plain.wait_ready()
        serve_ready = serve.wait_ready()
        print(
            f"ready: plain vLLM after {plain_ready:.0f} s, serve after {serve_ready:.0f} s (started together)",
            flush=True,
        )
        binds = role_binds(serve.role_pids())
        plain.track()
        serve.track()
        roles = {"plain": {}, "serve": serve.role_pids()}
        sides: list[tuple[str, PlainServer | ServeServer]] = [("plain", plain), ("serve", serve)]
        for name, server in sides:  # one unmeasured round each: batch shapes compiled, caches warm
            side_round(server, payloads, args.clients, roles[name])
        rounds: list[dict[str, Any]] = []
        for i in range(args.rounds):
            for name, server in sides:
                rounds.append({"round": i + 1, "side": name, **side_round(server, payloads, args.clients, roles[name])})
                print(
                    f"  round {i + 1} {name}: {rounds[-1]['tokens_per_s']:.1f} tok/s in {rounds[-1]['wall_s']:.2f} s",
                    flush=True,
                )
        plain.stop()
        window = time.monotonic() - (serve.ready_at or serve.started)
        serve_code = serve.stop()
        reports = [{"rank": d.rank, "report": d.report} for d in serve.ffn_reports()]
    finally:
        plain.stop()
        if serve is not None:
            serve.stop()
    leftovers = plain.leftovers() + serve.leftovers()
    return {
        "model": str(model),
        "clients": args.clients,
        "tokens": args.tokens,
        "requests": args.requests,
        "engine_args": engine_args,
        "topology": topology.label,
        "serve_afd": afd,
        "cores": {
            "machine": len(available),
            "plain": {"bind": plain_cores, "count": count_cores(plain_cores)},
            "serve": {name: {"bind": b, "count": count_cores(b)} for name, b in binds.items()},
        },
        "ready_s": {"plain": plain_ready, "serve": serve_ready},
        "rounds": rounds,
        "serve_exit": serve_code,
        "serving_window_s": window,
        "ffn_reports": reports,
        "residual_pids": leftovers,
        "load_average": {"start": load_start, "end": load_average()},
    }


def report(result: dict[str, Any]) -> str:
    rounds = result["rounds"]
    cores = result["cores"]
    serve_cores = sum(c["count"] for c in cores["serve"].values())
    pins = ", ".join(f"{name} -> cpu {c['bind']}" for name, c in cores["serve"].items())
    lines = [
        "",
        f"cores: plain vLLM pinned to {cores['plain']['count']} (cpu {cores['plain']['bind']}); "
        f"serve {result['topology']} pinned to {serve_cores} ({pins}); this machine: {cores['machine']}",
        "(the pin is vLLM's OpenMP compute threads; front ends, engine-core loops and serve's proxy float; "
        "'cores busy' is the CPU time every process of that side used / wall time; 'per role': each serve role's own)",
        "",
        format_table(
            ["round", "side", "output tokens", "wall s", "tok/s", "cores busy", "tok/s per busy core", "per role"],
            [
                [
                    r["round"],
                    r["side"],
                    r["output_tokens"],
                    r["wall_s"],
                    r["tokens_per_s"],
                    r["cores_busy"],
                    r["tokens_per_s"] / max(r["cores_busy"], 1e-9),
                    ", ".join(f"{n} {v:.2f}" for n, v in r["roles_cores_busy"].items()) or "-",
                ]
                for r in rounds
            ],
        ),
        "",
    ]
    pairs = []
    for i in sorted({r["round"] for r in rounds}):
        p, s = (next(r for r in rounds if r["round"] == i and r["side"] == side) for side in ("plain", "serve"))
        pairs.append([i, p["tokens_per_s"], s["tokens_per_s"], s["tokens_per_s"] / p["tokens_per_s"]])
    ratios = [row[3] for row in pairs]
    median_row: list[object] = [
        "median",
        statistics.median(row[1] for row in pairs),
        statistics.median(row[2] for row in pairs),
        statistics.median(ratios),
    ]
    lines += [format_table(["round", "plain tok/s", "serve tok/s", "serve/plain"], [*pairs, median_row]), ""]
    result["median_ratio"] = statistics.median(ratios)
    window = result["serving_window_s"]
    if result["ffn_reports"]:
        lines += [
            f"FFN side: each role's 'afd-mrv2 ffn: done' report after SIGTERM (serve exit {result['serve_exit']}); "
            f"serving window = {window:.1f} s from serve's ready line to SIGTERM (warm-up items included)",
            ffn_table(result["ffn_reports"], window),
        ]
    else:
        lines.append(
            f"FFN side: no 'afd-mrv2 ffn: done' report in serve's log (serve exit {result['serve_exit']}; "
            "see its log): the per-role 'cores busy' above is the FFN's CPU share"
        )
    serve_busy = [r["cores_busy"] for r in rounds if r["side"] == "serve"]
    plain_busy = [r["cores_busy"] for r in rounds if r["side"] == "plain"]
    load = result["load_average"]
    lines += [
        "",
        f"median cores busy: plain {statistics.median(plain_busy):.2f}, serve {statistics.median(serve_busy):.2f}",
        f"load average (1/5/15 min): start {' '.join(f'{x:.2f}' for x in load['start'])}, "
        f"end {' '.join(f'{x:.2f}' for x in load['end'])}",
        f"residual processes after stop: {result['residual_pids'] or 'none'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parsed = guarded(PROG, lambda: parse_args(list(sys.argv[1:] if argv is None else argv)))
    if isinstance(parsed, int):
        return parsed
    args, engine_args = parsed
    result = guarded(PROG, lambda: run(args, engine_args))
    if isinstance(result, int):
        return result
    print(report(result), flush=True)
    write_json(args.json, result)
    return 1 if result["residual_pids"] else 0


if __name__ == "__main__":
    sys.exit(main())
