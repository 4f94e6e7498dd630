#!/usr/bin/env python3
"""M:N measured: one Attention group (A DP ranks of one vLLM deployment) against A independent engines, in one run.

    .venv-vllm/bin/python scripts/bench_groups.py MODEL [--attention 2] [--ffn 1] [--clients 16] [--requests 64]
        [--tokens 32] [--rounds 3] [--json OUT] [--logs DIR] [-- ENGINE ARGS]

Two sides on the same checkpoint, engine arguments (default ``--dtype float32 --max-model-len 256
--max-num-seqs 64 --seed 0``) and cores (serve pins each Attention process and FFN rank the same way on both):

* ``group``: ``afd-mrv2 serve --attention A --attention-groups 1 --ffn F``: each FFN rank computes each MoE
  layer once per step for all A ranks;
* ``engines``: ``afd-mrv2 serve --attention A --attention-groups A --ffn F``: A engines on their own clocks
  behind serve's endpoint, each served on its own loop.

Both start (one after the other), then one unmeasured round per side and ``--rounds`` measured rounds per side,
alternating, the idle side's every process stopped with SIGSTOP.  A round is R greedy ``ignore_eos`` completions
of N tokens from C concurrent clients.  Around each round the FFN ranks' live figures (``/afd/status``) are read
and differenced: expert computations, tokens, compute seconds, and how many Attention ranks met in each.

Reports per side the median output tok/s, FFN compute time per token and per expert call, tokens per call,
expert calls per round and the share with rows of several ranks; the group/engines ratios.  Exit 0 after a
run, 1 when a server failed or requests failed, 2 for bad input (docs/benchmarks-vllm.md, "M:N").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from serving import (
    ServerError,
    ServeServer,
    ServeTopology,
    UsageError,
    body,
    check_model,
    check_vllm,
    guarded,
    run_requests,
    write_json,
)

from afd_mrv2.table import format_table

DEFAULT_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "64", "--seed", "0"]
FIGURES_SETTLE_S = 2.5  # the roles publish their figures every second


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    head, engine = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="bench_groups.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint folder (afd-mrv2 make-model DIR --arch mixtral --size bench)")
    parser.add_argument("--attention", type=int, default=2, metavar="A", help="Attention DP ranks (default 2)")
    parser.add_argument("--ffn", type=int, default=1, metavar="F", help="FFN ranks (default 1)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--requests", type=int, default=64, help="requests per round (default 64)")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side (default 3)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    parser.add_argument("--logs", default="out/bench-groups", help="folder for the servers' logs (default %(default)s)")
    args = parser.parse_args(head)
    if args.attention < 2 or args.ffn < 1 or min(args.clients, args.requests, args.tokens, args.rounds) < 1:
        raise UsageError("--attention must be >= 2 and --ffn, --clients, --requests, --tokens, --rounds >= 1")
    return args, engine or DEFAULT_ENGINE_ARGS


def ffn_figures(url: str, ffn: int) -> dict[str, float]:
    """The FFN ranks' counters now, summed: expert calls, tokens, compute seconds, calls with rows of >= 2 ranks."""
    with urllib.request.urlopen(url + "/afd/status", timeout=30) as resp:
        figures = json.loads(resp.read())["figures"]
    total = {"calls": 0.0, "tokens": 0.0, "busy_s": 0.0, "mixed": 0.0}
    for f in range(ffn):
        doc = figures.get(f"ffn {f}") or {}
        total["calls"] += doc.get("computed", 0)
        total["tokens"] += doc.get("tokens", 0)
        total["busy_s"] += doc.get("busy_s", 0.0)
        total["mixed"] += sum(n for k, n in (doc.get("ranks_per_call") or {}).items() if int(k) >= 2)
    return total


def measure(
    server: ServeServer, others: list[ServeServer], payloads: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """One round on ``server`` with ``others`` paused: tok/s and the FFN ranks' counters over it."""
    for other in others:
        other.pause()
    server.resume()
    time.sleep(FIGURES_SETTLE_S)
    before = ffn_figures(server.url, args.ffn)
    result = run_requests(server.url, payloads, args.clients)
    if result.failures:
        raise ServerError(f"{len(result.failures)} of {len(payloads)} requests failed: {result.failures[0]}")
    time.sleep(FIGURES_SETTLE_S)
    after = ffn_figures(server.url, args.ffn)
    delta = {k: after[k] - before[k] for k in after}
    tokens = max(delta["tokens"], 1.0)
    calls = max(delta["calls"], 1.0)
    return {
        "tokens_per_s": result.tokens_per_s,
        "wall_s": result.wall_s,
        "expert_calls": delta["calls"],
        "ffn_tokens": delta["tokens"],
        "ffn_busy_s": delta["busy_s"],
        "ffn_us_per_token": 1e6 * delta["busy_s"] / tokens,
        "ffn_ms_per_call": 1e3 * delta["busy_s"] / calls,
        "tokens_per_call": delta["tokens"] / calls,
        "mixed_share": delta["mixed"] / calls,
    }


def run(args: argparse.Namespace, engine_args: list[str]) -> dict[str, Any]:
    model = check_model(args.model)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    payloads = [body(model, f"the river {i} runs", args.tokens) for i in range(args.requests)]
    layouts = {"group": 1, "engines": None}  # None: one engine per rank (the harness's --attention-groups A)
    sides: dict[str, ServeServer] = {}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    ready: dict[str, float] = {}
    try:
        for i, (name, groups) in enumerate(layouts.items()):
            topology = ServeTopology(args.attention, args.ffn, groups=groups)
            port = 19100 + 20 * i
            sides[name] = ServeServer(model, port, logs / f"{name}.log", topology, engine_args)
            ready[name] = sides[name].wait_ready()
            sides[name].pause()
        for n in range(args.rounds + 1):
            for name, server in sides.items():
                others = [s for other, s in sides.items() if other != name]
                got = measure(server, others, payloads, args)
                if n:  # the first round of each side warms it up
                    rounds[name].append(got)
                print(
                    f"round {n} {name}: {got['tokens_per_s']:.1f} tok/s, {got['ffn_us_per_token']:.1f} us/token",
                    flush=True,
                )
    finally:
        for server in sides.values():
            server.stop()
    summary = {name: {k: statistics.median(r[k] for r in got) for k in got[0]} for name, got in rounds.items()}
    ratios = {
        "tokens_per_s": summary["group"]["tokens_per_s"] / summary["engines"]["tokens_per_s"],
        "ffn_us_per_token": summary["group"]["ffn_us_per_token"] / summary["engines"]["ffn_us_per_token"],
    }
    return {
        "args": vars(args),
        "engine_args": engine_args,
        "ready_s": ready,
        "rounds": rounds,
        "median": summary,
        "group_over_engines": ratios,
    }


def report(result: dict[str, Any]) -> str:
    rows = [
        (
            name,
            f"{m['tokens_per_s']:.1f}",
            f"{m['ffn_us_per_token']:.1f}",
            f"{m['ffn_ms_per_call']:.3f}",
            f"{m['tokens_per_call']:.1f}",
            f"{m['expert_calls']:.0f}",
            f"{m['mixed_share']:.3f}",
        )
        for name, m in result["median"].items()
    ]
    head = ["side", "tok/s", "FFN us/token", "FFN ms/call", "tokens/call", "expert calls", "calls with >= 2 ranks"]
    r = result["group_over_engines"]
    args = result["args"]
    return "\n".join(
        [
            f"bench_groups: {args['attention']} Attention ranks, {args['ffn']} FFN rank(s); {args['requests']} requests x "
            f"{args['tokens']} tokens from {args['clients']} clients, medians of {args['rounds']} rounds per side",
            format_table(head, rows),
            f"group / engines: tok/s {r['tokens_per_s']:.3f}, FFN compute per token {r['ffn_us_per_token']:.3f}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    def body_() -> int:
        args, engine = parse_args(list(sys.argv[1:] if argv is None else argv))
        check_vllm()
        result = run(args, engine)
        print(report(result))
        write_json(args.json, result)
        return 0

    return guarded("bench_groups.py", body_)


if __name__ == "__main__":
    sys.exit(main())
