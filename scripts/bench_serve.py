#!/usr/bin/env python3
"""Output-token throughput and per-step forward time of plain vLLM, blocking AFD and micro-batched AFD, in one run.

    .venv-vllm/bin/python scripts/bench_serve.py MODEL [--clients 64] [--tokens 64] [--requests 64] [--rounds 3]
        [--attention A --ffn F] [--ubatches N] [--afd JSON] [--depth D] [--plain-cores LIST] [--no-trace]
        [--stop-grace-s S] [--engine-core-nice N] [--json OUT] [--logs DIR] [-- ENGINE ARGS]

Three sides, all on vLLM's Model Runner V2 (on CPU through the test-only triton stand-in
``tests/vllm/triton_cpu_standin``, eager), the same checkpoint and engine arguments (default
``--dtype float32 --max-model-len 256 --max-num-seqs 64 --seed 0 --enforce-eager``):

* ``plain``: plain vLLM's OpenAI server (``VLLM_USE_V2_MODEL_RUNNER=1``), every process of it pinned to
  ``--plain-cores`` (default: every core this process may use);
* ``blocking``: ``afd-mrv2 serve --ubatches 1`` (A Attention engines + F FFN roles, default 1A1F; every MoE
  layer one blocking round trip), each role pinned to cores of its own by serve;
* ``ubatch``: ``afd-mrv2 serve --ubatches N`` (default 2): steps at or above the ``afd.ubatch`` token
  thresholds (decode 32, prefill 512 unless ``--afd`` says otherwise) split into N micro-batches.

All three start together; then one unmeasured round per side and ``--rounds`` measured rounds per side,
alternating plain / blocking / ubatch / plain ...  While one side runs, every process of the other two
(front ends, EngineCore and worker processes, FFN roles, serve and its proxy) is stopped with SIGSTOP and
checked to be in state ``T``; SIGCONT resumes them.  A round is R greedy ``ignore_eos`` completions of N
tokens from C concurrent clients.  Around each round the script reads the side's engine-step count
(``vllm:iteration_tokens_total``) and, on the AFD sides, each Attention engine's ``afd_attention_stats``
(``POST /collective_rpc``, ``VLLM_SERVER_DEV_MODE=1``): the runner's forward times (``forward_ms_recent``)
and the round-trip / compute overlap counters, differenced over the round.  Then every server is stopped
(one at a time, the others still paused; an AFD side's engines answer ``afd_attention_stats`` once more just
before) and each FFN role's ``afd-mrv2 ffn: done {...}`` report read.

Reports per round tok/s, steps, wall and forward ms per step and the CPU time of every process; per side
the median tok/s and median forward ms; the ratios ubatch/blocking and ubatch/plain; the ubatch side's
hidden fraction; and the analytic limit of the forward speedup, (A + F + 2c) / max(N a, N f, a + f + 2c),
with each input; and where a round trip goes, per AFD side: the nine spans of the connector's
``round_trip_stamps`` (means over the whole run), their sum and the measured mean round trip
(docs/benchmarks-vllm.md).  Exit 0 after a run, 1 when a server failed, requests failed
or a process was left, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving import (
    PlainServer,
    ServerError,
    ServeServer,
    ServeTopology,
    UsageError,
    body,
    check_model,
    check_vllm,
    collective_rpc,
    count_cores,
    engine_steps,
    guarded,
    load_average,
    parse_cpu_list,
    process_cpu,
    prompts,
    role_binds,
    run_requests,
    write_json,
)
from serving.matrix import STANDIN

from afd_mrv2.hooks.p2p.stamps import SPANS, breakdown
from afd_mrv2.ports import free_port_block
from afd_mrv2.table import format_table

PROG = "bench_serve"
#: Every process of the run (plain vLLM, serve and, through serve's environment, its roles).
STANDIN_ENV = {"TRITON_INTERPRET": "1", "AFD_MRV2_TEST_TRITON_CPU_STANDIN": "1"}
#: Plain vLLM selects V2 itself; serve selects it for its Attention engines under --ubatches.
PLAIN_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
#: serve's Attention engines answer POST /collective_rpc (afd_attention_stats).
SERVE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
EAGER = "--enforce-eager"
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "64", "--seed", "0", EAGER]
#: What plain vLLM logs when it runs Model Runner V2.
V2_LOG = "Using V2 Model Runner"
SIDES = ("plain", "blocking", "ubatch")
#: serve --stop-grace-s: a vLLM Attention engine on a loaded 2-core machine takes several seconds to exit, and
#: an FFN role reports only after its engines are gone (serve's default 5 s grace SIGKILLs it first).
STOP_GRACE_S = 60.0
#: a round trip's overhead over the FFN compute (2c) that the analytic block also evaluates the limit at
OVERHEAD_BAR_MS = 0.5
OVERLAP_SUMS = ("steps", "round_trips", "round_trip_total_ms", "hidden_total_ms", "computes", "compute_total_ms")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    head, engine = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, ENGINE_ARGS)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("model", help="a checkpoint folder (afd-mrv2 make-model DIR --arch mixtral)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--requests", type=int, default=64, help="requests per round (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side (default 3)")
    parser.add_argument("--attention", type=int, default=1, metavar="A", help="serve's Attention engines (default 1)")
    parser.add_argument("--ffn", type=int, default=1, metavar="F", help="serve's FFN ranks (default 1)")
    parser.add_argument("--ubatches", type=int, default=2, metavar="N", help="the ubatch side's micro-batches (2..4)")
    parser.add_argument(
        "--afd",
        metavar="JSON",
        help='base afd section of both serve sides, e.g. \'{"ubatch": {"decode_token_threshold": 16}}\'',
    )
    parser.add_argument("--depth", metavar="D|auto", help="serve --depth (FFN multistream depth) on both serve sides")
    parser.add_argument("--plain-cores", metavar="LIST", help="cores for plain vLLM, e.g. 0,1 (default: all)")
    parser.add_argument("--no-trace", action="store_true", help="no afd.multistream.trace (no FFN overlap figures)")
    parser.add_argument(
        "--stop-grace-s",
        "--stop-grace",  # the spelling before afd-mrv2 0.3.0 (serve's flag then), still accepted
        dest="stop_grace",
        type=float,
        default=STOP_GRACE_S,
        metavar="S",
        help="serve --stop-grace-s (default %(default)g)",
    )
    parser.add_argument(
        "--engine-core-nice",
        type=int,
        default=None,
        metavar="N",
        help="renice every thread of every side's vLLM EngineCore process to N (1..19) once ready: its "
        "busy-poll of the worker's reply (sched_yield for 1 s after each reply) then yields the core to "
        "compute; applied to all three sides alike (default: unchanged)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    parser.add_argument("--logs", default="out/bench-serve", help="folder for the servers' logs (default %(default)s)")
    args = parser.parse_args(head)
    for name in ("clients", "tokens", "requests", "rounds", "attention", "ffn"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    if args.ubatches < 2:
        raise UsageError(f"--ubatches: expected an integer >= 2 (1 is the blocking side), got {args.ubatches}")
    if args.engine_core_nice is not None and not 1 <= args.engine_core_nice <= 19:
        raise UsageError(f"--engine-core-nice: expected an integer 1..19, got {args.engine_core_nice}")
    if args.stop_grace <= 0:
        raise UsageError(f"--stop-grace-s: expected seconds > 0, got {args.stop_grace:g}")
    if args.afd is not None:
        try:
            args.afd = json.loads(args.afd)
        except ValueError as exc:
            raise UsageError(f"--afd: expected a JSON object, got {args.afd!r} ({exc})") from None
        if not isinstance(args.afd, dict):
            raise UsageError(f"--afd: expected a JSON object, got {type(args.afd).__name__}")
    engine = list(engine)
    if EAGER not in engine:  # plain V2 on CPU needs it; serve adds it for its Attention engines anyway
        engine.append(EAGER)
    return args, engine


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _environment() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH")) if p)
    return {**STANDIN_ENV, "PYTHONPATH": path}


@dataclass
class Side:
    """One measured server, and how long it ran unpaused since it was ready."""

    name: str
    server: PlainServer | ServeServer
    ready_s: float = 0.0
    running_s: float = 0.0
    _since: float | None = None  # when it last started running; None while paused

    @property
    def afd(self) -> bool:
        return isinstance(self.server, ServeServer)

    def ready(self) -> None:
        self._since = time.monotonic()

    def pause(self) -> None:
        if self._since is not None:
            self.running_s += time.monotonic() - self._since
            self._since = None
            self.server.pause()

    def resume(self) -> None:
        if self._since is None:
            self.server.resume()
            self._since = time.monotonic()

    def settle(self) -> None:
        """Stop the running clock (the server is about to stop)."""
        if self._since is not None:
            self.running_s += time.monotonic() - self._since
            self._since = None

    def urls(self) -> list[str]:
        return self.server.engine_urls() if isinstance(self.server, ServeServer) else [self.server.url]


def renice_engine_cores(server: PlainServer | ServeServer, nice: int) -> list[int]:
    """Set every thread of the server's vLLM EngineCore processes to ``nice``; returns their pids."""
    pids = [pid for pid, label in server.processes().items() if "EngineCore" in label]
    if not pids:
        raise ServerError(f"--engine-core-nice: no EngineCore process found under pid {server.proc.pid}")
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    return pids


def snapshot(side: Side) -> dict[str, Any]:
    """The side's engine-step counts and, on an AFD side, each Attention engine's afd_attention_stats (worker 0)."""
    snap: dict[str, Any] = {"steps_metric": [engine_steps(url) for url in side.urls()]}
    if side.afd:
        stats = []
        for url in side.urls():
            result = collective_rpc(url, "afd_attention_stats")
            if not result or not isinstance(result[0], dict):
                raise ServerError(f"{side.name}: {url} afd_attention_stats answered {str(result)[:200]}")
            stats.append(result[0])
        snap["stats"] = stats
    return snap


def _overlap_diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for stages, now in after.items():
        then = before.get(stages, {})
        out[stages] = {key: now[key] - then.get(key, 0) for key in OVERLAP_SUMS}
    return out


def _overlap_add(total: dict[str, dict[str, float]], more: dict[str, dict[str, float]]) -> None:
    for stages, sums in more.items():
        into = total.setdefault(stages, dict.fromkeys(OVERLAP_SUMS, 0))
        for key in OVERLAP_SUMS:
            into[key] += sums[key]


def overlap_means(sums: dict[str, float]) -> dict[str, float]:
    """The counters of a window with the means :mod:`afd_mrv2.mrv2.attention.overlap` derives from them."""
    rt, computes = sums["round_trips"], sums["computes"]
    return {
        **sums,
        "hidden_fraction": sums["hidden_total_ms"] / sums["round_trip_total_ms"]
        if sums["round_trip_total_ms"]
        else 0.0,
        "round_trip_ms": sums["round_trip_total_ms"] / rt if rt else 0.0,
        "compute_ms": sums["compute_total_ms"] / computes if computes else 0.0,
    }


def _counter_diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, int]:
    return {k: int(v) - int(before.get(k, 0)) for k, v in after.items() if int(v) - int(before.get(k, 0))}


def window(side: Side, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the side's counters say about one round: steps, and on an AFD side forwards, overlap, items."""
    metric = [
        None if a is None or b is None else a - b
        for a, b in zip(after["steps_metric"], before["steps_metric"], strict=True)
    ]
    out: dict[str, Any] = {"steps_metric": None if None in metric else sum(m for m in metric if m is not None)}
    if not side.afd:
        out["steps"] = out["steps_metric"]
        return out
    forwards: list[tuple[int, int, str, float]] = []  # (engine, index, stage count, ms) of the window's forwards
    overlap: dict[str, dict[str, float]] = {}
    steps_by_kind: dict[str, dict[str, int]] = {}
    items: dict[str, int] = {}
    calls, lost, failed = 0, 0, 0
    for engine, (then, now) in enumerate(zip(before["stats"], after["stats"], strict=True)):
        r0, r1 = then.get("runner"), now.get("runner")
        if r0 is None or r1 is None:
            raise ServerError(f"{side.name}: afd_attention_stats has no 'runner' (not afd-mrv2's V2 Attention runner)")
        first = int(r0["forwards"])
        got = [
            (engine, i, n, float(ms)) for n, pairs in r1["forward_ms_recent"].items() for i, ms in pairs if i >= first
        ]
        lost += int(r1["forwards"]) - first - len(got)  # beyond the kept window (4096 per stage count)
        forwards += sorted(got)  # in the order they ran
        failed += int(r1["failed_steps"]) - int(r0["failed_steps"])
        for kind, counts in r1["steps"].items():
            diff = _counter_diff(counts, r0["steps"].get(kind, {}))
            for n, c in diff.items():
                steps_by_kind.setdefault(kind, {}).setdefault(n, 0)
                steps_by_kind[kind][n] += c
        _overlap_add(overlap, _overlap_diff(now["overlap"], then["overlap"]))
        calls += int(now["calls"]) - int(then["calls"])
        for n, c in _counter_diff(now["items_by_stage_count"], then["items_by_stage_count"]).items():
            items[n] = items.get(n, 0) + c
    out.update(
        steps=sum(c for counts in steps_by_kind.values() for c in counts.values()),
        steps_by_kind=steps_by_kind,
        failed_steps=failed,
        forward_ms=[ms for _, _, _, ms in forwards],
        forward_stages=[n for _, _, n, _ in forwards],
        forwards_lost=lost,
        overlap=overlap,
        calls=calls,
        items_by_stage_count=items,
    )
    return out


def bound_cores(log: str, prefix: str = "") -> dict[str, str]:
    """The core ids vLLM logged for each engine's OpenMP threads (``core ids=[...]``), by role prefix."""
    found: dict[str, str] = {}
    for line in log.splitlines():
        if "core ids=" in line and line.startswith(prefix):
            role = line[1:].split("]", 1)[0] if line.startswith("[") else "plain"
            found[role] = line.split("core ids=", 1)[1].strip()
    return found


def measure_round(sides: dict[str, Side], name: str, payloads: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    """One round on side ``name`` with every other side paused (checked): throughput, CPU per process, counters."""
    side = sides[name]
    for other in sides.values():
        if other is not side:
            other.pause()
    side.resume()
    paused = {n: s.server.track() for n, s in sides.items() if s is not side}
    running = {n: s.server.not_stopped() for n, s in sides.items() if s is not side}
    if any(running.values()):
        raise ServerError(f"paused sides still running (state not T) before round of {name}: {running}")
    before = snapshot(side)
    labels = side.server.processes()
    paused_pids = [pid for pids in paused.values() for pid in pids]
    paused0 = sum(process_cpu(paused_pids).values())
    cpu0 = process_cpu(list(labels))
    result = run_requests(side.server.url, payloads, clients)
    cpu1 = process_cpu(list(labels))
    paused_cpu = sum(process_cpu(paused_pids).values()) - paused0
    after = snapshot(side)
    side.server.track()
    if result.failures:
        raise ServerError(f"{name}: {len(result.failures)} of {len(payloads)} requests failed: {result.failures[0]}")
    processes: dict[str, float] = {}
    for pid, label in labels.items():
        processes[label] = processes.get(label, 0.0) + cpu1.get(pid, cpu0.get(pid, 0.0)) - cpu0.get(pid, 0.0)
    cpu = sum(processes.values())
    return {
        "side": name,
        "wall_s": result.wall_s,
        "output_tokens": result.output_tokens,
        "tokens_per_s": result.tokens_per_s,
        "cpu_s": cpu,
        "cores_busy": cpu / result.wall_s,
        "processes_cpu_s": processes,
        "paused_pids": len(paused_pids),
        "paused_cpu_s": paused_cpu,
        **window(side, before, after),
    }


def side_summary(side: Side, rounds: list[dict[str, Any]], engines: int) -> dict[str, Any]:
    """Medians over the side's measured rounds, its per-step split, and (AFD) its window's overlap counters."""
    mine = [r for r in rounds if r["side"] == side.name]
    wall = sum(r["wall_s"] for r in mine)
    steps = [r["steps"] for r in mine]
    known = None not in steps
    out: dict[str, Any] = {
        "rounds": len(mine),
        "median_tok_s": statistics.median(r["tokens_per_s"] for r in mine),
        "tok_s": [r["tokens_per_s"] for r in mine],
        "median_cores_busy": statistics.median(r["cores_busy"] for r in mine),
        "steps": sum(steps) if known else None,
        # each engine steps on its own: a step's wall time is the round's wall time over one engine's steps
        "wall_ms_per_step": 1000 * wall * engines / sum(steps) if known and sum(steps) else None,
    }
    if not side.afd:
        out["median_forward_ms"] = None
        out["forward_ms_note"] = "plain vLLM has no Attention runner counters: no forward time"
        return out
    forwards = [ms for r in mine for ms in r["forward_ms"]]
    stages = [n for r in mine for n in r["forward_stages"]]
    overlap: dict[str, dict[str, float]] = {}
    for r in mine:
        _overlap_add(overlap, r["overlap"])
    by_stage = {}
    for n in sorted(set(stages)):
        times = [ms for ms, s in zip(forwards, stages, strict=True) if s == n]
        by_stage[n] = {"count": len(times), "median_ms": statistics.median(times), "mean_ms": statistics.fmean(times)}
    forward_per_step = sum(forwards) * engines / sum(steps) if steps and sum(steps) else None
    out.update(
        median_forward_ms=statistics.median(forwards) if forwards else None,
        forward_ms_by_stage_count=by_stage,
        forward_ms_per_step=forward_per_step,
        rest_ms_per_step=(
            out["wall_ms_per_step"] - forward_per_step
            if out["wall_ms_per_step"] is not None and forward_per_step is not None
            else None
        ),
        forwards=len(forwards),
        forwards_lost=sum(r["forwards_lost"] for r in mine),
        failed_steps=sum(r["failed_steps"] for r in mine),
        steps_metric=sum(r["steps_metric"] for r in mine) if None not in [r["steps_metric"] for r in mine] else None,
        split_steps=sum(c for r in mine for k in r["steps_by_kind"].values() for n, c in k.items() if n != "1"),
        overlap={n: overlap_means(s) for n, s in sorted(overlap.items())},
    )
    return out


def ffn_compute_per_item(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """busy_s / computed of a side's FFN ranks (all ranks together), and the mean tokens of a computed item."""
    busy = sum(float(r["report"].get("busy_s", 0.0)) for r in reports)
    computed = sum(int(r["report"].get("computed", 0)) for r in reports)
    if not reports or not computed:
        return None
    per_item: dict[int, int] = {}
    for r in reports:
        for k, v in (r["report"].get("tokens_per_item") or {}).items():
            per_item[int(k)] = per_item.get(int(k), 0) + int(v)
    tokens = sum(k * v for k, v in per_item.items()) / max(1, sum(per_item.values()))
    return {"busy_s": busy, "computed": computed, "ms": 1000 * busy / computed, "tokens_per_item": tokens}


def schedule_forward_ms(n: int, layers: int, a: float, f: float, c: float) -> float:
    """A forward's MoE part as a schedule: ``layers`` MoE layers, ``n`` micro-batches, the Attention side
    computing ``a`` per micro-batch and layer and the FFN ``f`` per item, each one at a time and in order
    (layer by layer, micro-batch by micro-batch), ``c`` per transfer each way.  The pipeline fills and drains
    once per forward, which the per-layer limit leaves out; ``n = 1`` is the blocking forward,
    ``layers * (a + f + 2c)``."""
    attention_free = ffn_free = 0.0
    back = [0.0] * n  # when each micro-batch's last combine arrived
    for _ in range(layers):
        for u in range(n):
            attention_free = max(attention_free, back[u]) + a
            ffn_free = max(ffn_free, attention_free + c) + f
            back[u] = ffn_free + c
    return max(back)


def _moe_layers(reports: list[dict[str, Any]]) -> int | None:
    """The MoE layers an FFN side's ``done`` report names (``moe_layers``), or None."""
    found = {int(r["report"]["moe_layers"]) for r in reports if "moe_layers" in r["report"]}
    return found.pop() if len(found) == 1 else None


def analytic(result: dict[str, Any], n: int) -> dict[str, Any]:
    """The limit of the forward speedup, (A + F + 2c) / max(N a, N f, a + f + 2c), and its inputs (or why not)."""
    blocking, ubatch = result["sides"]["blocking"], result["sides"]["ubatch"]
    unsplit, split = blocking["overlap"].get("1"), ubatch["overlap"].get(str(n))
    ffn_b, ffn_u = (ffn_compute_per_item(result["ffn_reports"][s]) for s in ("blocking", "ubatch"))
    missing = [
        why
        for why, value in (
            ("no unsplit round trip on the blocking side", unsplit and unsplit["round_trips"]),
            (f"no step split into {n} on the ubatch side", split and split["computes"]),
            ("no FFN 'done' report (computed items) from the blocking side", ffn_b),
            ("no FFN 'done' report (computed items) from the ubatch side", ffn_u),
        )
        if not value
    ]
    if missing:
        return {"analytic_limit": None, "why_not": "; ".join(missing)}
    assert unsplit is not None and split is not None and ffn_b is not None and ffn_u is not None
    big_a, big_f, a, f = unsplit["compute_ms"], ffn_b["ms"], split["compute_ms"], ffn_u["ms"]
    c = (unsplit["round_trip_ms"] - big_f) / 2
    num, terms = big_a + big_f + 2 * c, {"N a": n * a, "N f": n * f, "a + f + 2c": a + f + 2 * c}

    def limit_at(overhead_ms: float) -> float:  # the same computes, a round trip costing F + overhead
        return (big_a + big_f + overhead_ms) / max(n * a, n * f, a + f + overhead_ms)

    limit = limit_at(2 * c)

    layers = _moe_layers(result["ffn_reports"]["blocking"])

    def forward_bound(transfer_ms: float) -> float | None:  # the schedule of a whole forward (fill and drain)
        if layers is None:
            return None
        blocking_ms = schedule_forward_ms(1, layers, big_a, big_f, transfer_ms)
        return blocking_ms / schedule_forward_ms(n, layers, a, f, transfer_ms)

    speedup = (
        blocking["median_forward_ms"] / ubatch["median_forward_ms"]
        if blocking["median_forward_ms"] and ubatch["median_forward_ms"]
        else None
    )
    return {
        "N": n,
        "A_ms": big_a,
        "F_ms": big_f,
        "a_ms": a,
        "f_ms": f,
        "c_ms": c,
        "blocking_round_trip_ms": unsplit["round_trip_ms"],
        "ffn_blocking": ffn_b,
        "ffn_ubatch": ffn_u,
        "numerator_ms": num,
        "terms_ms": terms,
        "bound_by": max(terms, key=lambda k: terms[k]),
        "analytic_limit": limit,
        # what a faster transport could give these computes: a free one (2c = 0), and one at OVERHEAD_BAR_MS
        "limit_free_transport": limit_at(0.0),
        "limit_at_overhead_bar": limit_at(OVERHEAD_BAR_MS),
        # the same as a schedule of a whole forward of ``moe_layers`` layers (None without the FFN's report of it)
        "moe_layers": layers,
        "forward_bound": forward_bound(c),
        "forward_bound_free_transport": forward_bound(0.0),
        "measured_forward_speedup": speedup,
        "fraction_of_limit": speedup / limit if speedup is not None else None,
    }


def _check_prerequisites(args: argparse.Namespace) -> Path:
    """The checkpoint, once vLLM and the test-only stand-in are known to be there."""
    model = check_model(args.model)
    check_vllm()
    if not (STANDIN / "sitecustomize.py").is_file():
        raise UsageError(
            f"{STANDIN}/sitecustomize.py is missing: vLLM's V2 runner on CPU needs this test-only stand-in"
        )
    return model


def _start_sides(
    args: argparse.Namespace,
    model: Path,
    topologies: dict[str, ServeTopology],
    engine_args: list[str],
    plain_cores: str,
    started: list[PlainServer | ServeServer],
) -> dict[str, Side]:
    """Start the three sides together (each appended to ``started`` once it runs) and wait until all are ready."""
    logs = Path(args.logs)
    env = _environment()
    ports = [topologies[name].ports() for name in ("blocking", "ubatch")]
    base = free_port_block(1 + sum(ports))
    plain = PlainServer(model, base, logs / "plain.log", engine_args, plain_cores, env={**env, **PLAIN_ENV})
    started.append(plain)
    sides = {"plain": Side("plain", plain)}
    port = base + 1
    for name, count in zip(("blocking", "ubatch"), ports, strict=True):
        serve = ServeServer(model, port, logs / f"{name}.log", topologies[name], engine_args, env={**env, **SERVE_ENV})
        started.append(serve)
        sides[name] = Side(name, serve)
        port += count
    for side in sides.values():
        side.ready_s = side.server.wait_ready()
        side.ready()
    print(
        "ready: " + ", ".join(f"{n} after {s.ready_s:.0f} s" for n, s in sides.items()) + " (started together)",
        flush=True,
    )
    return sides


def _renice(sides: dict[str, Side], nice: int | None) -> None:
    if nice is None:
        return
    reniced = {n: renice_engine_cores(s.server, nice) for n, s in sides.items()}
    print(
        f"EngineCore processes at nice {nice}: " + ", ".join(f"{n} {pids}" for n, pids in reniced.items()), flush=True
    )


def _check_runners(sides: dict[str, Side], ubatches: int) -> None:
    """Plain vLLM runs Model Runner V2, and each AFD side's Attention runner splits as asked."""
    plain = sides["plain"].server
    if V2_LOG not in plain.log_text():
        raise ServerError(f"plain vLLM did not log {V2_LOG!r} (log {plain.log})")
    for name, want in (("blocking", 1), ("ubatch", ubatches)):
        for stats in snapshot(sides[name])["stats"]:
            got = (stats.get("runner") or {}).get("num_ubatches")
            if got != want:
                raise ServerError(f"{name}: the Attention runner reports num_ubatches {got}, expected {want}")


def _measure_rounds(
    sides: dict[str, Side], payloads: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One unmeasured round per side (batch shapes seen, caches warm), then ``args.rounds`` measured ones, alternating."""
    for name in SIDES:
        measure_round(sides, name, payloads, args.clients)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for name in SIDES:
            rounds.append({"round": i + 1, **measure_round(sides, name, payloads, args.clients)})
            r = rounds[-1]
            forward = f", forward median {statistics.median(r['forward_ms']):.2f} ms" if r.get("forward_ms") else ""
            print(
                f"  round {i + 1} {name}: {r['tokens_per_s']:.1f} tok/s in {r['wall_s']:.2f} s, "
                f"{r['steps']} steps{forward}",
                flush=True,
            )
    return rounds


Reports = dict[str, list[dict[str, Any]]]


def _stop_sides(sides: dict[str, Side]) -> tuple[dict[str, int | None], Reports, Reports]:
    """Each side's exit code, its FFN roles' reports and (AFD sides) each Attention engine's last
    afd_attention_stats, read just before the side stops; one side stops at a time (the others still
    paused: each FFN role reports on a quiet machine)."""
    exits: dict[str, int | None] = {}
    final: Reports = {}
    for name in SIDES:
        side = sides[name]
        if side.afd:
            side.resume()  # a paused engine answers no collective_rpc
            try:
                final[name] = snapshot(side)["stats"]
            except ServerError as exc:  # the run's figures stand without this side's breakdown
                print(f"{name}: no round-trip breakdown: {exc}", flush=True)
                final[name] = []
        side.settle()
        exits[name] = side.server.stop()
    reports = {
        name: [{"rank": d.rank, "report": d.report} for d in sides[name].server.ffn_reports()]  # type: ignore[union-attr]
        for name in ("blocking", "ubatch")
    }
    return exits, reports, final


def round_trip_breakdown(final: Reports, reports: Reports, ffn_ranks: int) -> dict[str, Any]:
    """Per AFD side and Attention engine: where its round trips went, means over the whole run (warm-up
    included) from its ``round_trip_stamps`` and, with one FFN rank, that rank's stamps for the engine
    (:func:`afd_mrv2.hooks.p2p.stamps.breakdown`); with the engine's measured mean round trip (overlap
    counters: exchange.start to the last combine's arrival)."""
    out: dict[str, Any] = {"ffn_ranks": ffn_ranks, "sides": {}}
    for name, engines in final.items():
        ffn = reports.get(name, [])
        out["sides"][name] = side = []
        for a, stats in enumerate(engines):
            mine = stats.get("round_trip_stamps")  # None: another connector than torch_p2p
            theirs = None
            if ffn_ranks == 1 and len(ffn) == 1:
                theirs = (ffn[0]["report"].get("round_trip_stamps") or {}).get(str(a))
            totals = list(stats["overlap"].values())
            trips = sum(t["round_trips"] for t in totals)
            measured = 1000 * sum(t["round_trip_total_ms"] for t in totals) / trips if trips else None
            side.append(
                {
                    "engine": a,
                    "attention_stamps": mine,
                    "ffn_stamps": theirs,
                    "spans_us": None if mine is None else breakdown(mine, theirs),
                    "measured_round_trip_us": measured,
                }
            )
    return out


def _add_summaries(result: dict[str, Any], sides: dict[str, Side], args: argparse.Namespace) -> None:
    """Per side summaries, the analytic limit and the ratios, into ``result``."""
    result["sides"] = {
        name: side_summary(sides[name], result["rounds"], 1 if name == "plain" else args.attention) for name in SIDES
    }
    limit = analytic(result, args.ubatches)
    result["analytic"] = limit
    ubatch, blocking, plain_side = (result["sides"][n] for n in ("ubatch", "blocking", "plain"))
    ubatch["hidden_fraction"] = ubatch["overlap"].get(str(args.ubatches), {}).get("hidden_fraction")
    ubatch["analytic_limit"] = limit["analytic_limit"]
    result["ratios"] = {
        "ubatch/blocking tok_s": ubatch["median_tok_s"] / blocking["median_tok_s"],
        "ubatch/blocking forward_ms": (
            ubatch["median_forward_ms"] / blocking["median_forward_ms"]
            if ubatch["median_forward_ms"] and blocking["median_forward_ms"]
            else None
        ),
        "ubatch/plain tok_s": ubatch["median_tok_s"] / plain_side["median_tok_s"],
    }


def run(args: argparse.Namespace, engine_args: list[str]) -> dict[str, Any]:
    model = _check_prerequisites(args)
    available = sorted(os.sched_getaffinity(0))
    plain_cores = args.plain_cores or ",".join(str(c) for c in available)
    parse_cpu_list(plain_cores)
    afd = _merge({} if args.no_trace else {"multistream": {"trace": True}}, args.afd or {})
    topologies = {
        name: ServeTopology(args.attention, args.ffn, args.depth, afd or None, ubatches=u, stop_grace=args.stop_grace)
        for name, u in (("blocking", 1), ("ubatch", args.ubatches))
    }
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    payloads = [body(model, p, args.tokens) for p in prompts(args.requests)]
    load_start = load_average()
    print(
        f"{PROG}: {model}, {args.clients} clients, {args.requests} requests x {args.tokens} tokens per round, "
        f"{args.rounds} rounds per side (alternating plain/blocking/ubatch), greedy, ignore_eos\n"
        f"engine args (every side): {' '.join(engine_args)}\n"
        f"sides (all Model Runner V2, eager): plain = vLLM's OpenAI server; blocking = afd-mrv2 serve "
        f"{topologies['blocking'].label}; ubatch = afd-mrv2 serve {topologies['ubatch'].label}; "
        f"serve --afd {json.dumps(afd)}",
        flush=True,
    )
    started: list[PlainServer | ServeServer] = []
    try:
        sides = _start_sides(args, model, topologies, engine_args, plain_cores, started)
        _renice(sides, args.engine_core_nice)
        _check_runners(sides, args.ubatches)
        binds = {n: role_binds(s.server.role_pids()) for n, s in sides.items() if isinstance(s.server, ServeServer)}
        engine_cores = {"plain": bound_cores(sides["plain"].server.log_text())}
        engine_cores.update({n: bound_cores(s.server.log_text(), "[") for n, s in sides.items() if s.afd})
        rounds = _measure_rounds(sides, payloads, args)
        exits, reports, final = _stop_sides(sides)
    finally:
        for server in started:
            server.stop()
    leftovers = sorted({pid for server in started for pid in server.leftovers()})
    result: dict[str, Any] = {
        "model": str(model),
        "clients": args.clients,
        "tokens": args.tokens,
        "requests": args.requests,
        "engine_args": engine_args,
        "topology": {n: t.label for n, t in topologies.items()},
        "ubatches": args.ubatches,
        "serve_afd": afd,
        "cores": {
            "machine": len(available),
            "plain": {"bind": plain_cores, "count": count_cores(plain_cores)},
            **{n: {role: {"bind": b, "count": count_cores(b)} for role, b in bs.items()} for n, bs in binds.items()},
        },
        "engine_core_ids": engine_cores,
        "engine_core_nice": args.engine_core_nice,
        "ready_s": {n: s.ready_s for n, s in sides.items()},
        "running_s": {n: s.running_s for n, s in sides.items()},
        "rounds": rounds,
        "serve_exit": {n: exits[n] for n in ("blocking", "ubatch")},
        "ffn_reports": reports,
        "round_trip": round_trip_breakdown(final, reports, args.ffn),
        "residual_pids": leftovers,
        "load_average": {"start": load_start, "end": load_average()},
    }
    _add_summaries(result, sides, args)
    return result


def _ms(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _cores(result: dict[str, Any]) -> str:
    cores = result["cores"]
    parts = [f"plain -> cpu {cores['plain']['bind']} ({cores['plain']['count']} cores)"]
    for name in ("blocking", "ubatch"):
        roles = cores.get(name, {})
        total = sum(c["count"] for c in roles.values())
        pins = ", ".join(f"{role} -> cpu {pin['bind']}" for role, pin in roles.items())
        parts.append(f"{name} {pins} ({total} cores)")
    logged = "; ".join(
        f"{n}: " + ", ".join(f"{r} {ids}" for r, ids in found.items()) for n, found in result["engine_core_ids"].items()
    )
    return f"cores (VLLM_CPU_OMP_THREADS_BIND): {'; '.join(parts)}; this machine: {cores['machine']}\n  vLLM logged core ids: {logged}"


def _by_stage(steps_by_kind: dict[str, dict[str, int]] | None) -> str:
    """``1: 2, 2: 15``: a round's steps by stage count, every batch kind together."""
    counts: dict[str, int] = {}
    for kinds in (steps_by_kind or {}).values():
        for n, c in kinds.items():
            counts[n] = counts.get(n, 0) + c
    return ", ".join(f"{n}: {c}" for n, c in sorted(counts.items(), key=lambda kv: int(kv[0]))) or "-"


def rounds_table(rounds: list[dict[str, Any]]) -> str:
    rows = []
    for r in rounds:
        wall_step = 1000 * r["wall_s"] / r["steps"] if r["steps"] else None
        forwards = r.get("forward_ms") or []
        fwd_step = sum(forwards) / r["steps"] if forwards and r["steps"] else None
        rows.append(
            [
                r["round"],
                r["side"],
                r["output_tokens"],
                r["wall_s"],
                r["tokens_per_s"],
                r["steps"] if r["steps"] is not None else "?",
                _ms(wall_step),
                _ms(fwd_step),
                _ms(wall_step - fwd_step if wall_step is not None and fwd_step is not None else None),
                _ms(statistics.median(forwards) if forwards else None),
                _by_stage(r.get("steps_by_kind")),
                r["cores_busy"],
            ]
        )
    table: str = format_table(
        [
            "round",
            "side",
            "output tokens",
            "wall s",
            "tok/s",
            "steps",
            "wall ms/step",
            "fwd ms/step",
            "rest ms/step",
            "fwd median ms",
            "steps by stage count",
            "cores busy",
        ],
        rows,
    )
    return table


def cpu_table(rounds: list[dict[str, Any]]) -> str:
    """Cores busy (CPU s / round wall s) of every process, per round and median, by side."""
    numbers = sorted({r["round"] for r in rounds})
    rows = []
    for side in SIDES:
        mine = {r["round"]: r for r in rounds if r["side"] == side}
        labels: list[str] = []
        for r in mine.values():
            labels += [label for label in r["processes_cpu_s"] if label not in labels]
        for label in [*sorted(labels), "all"]:
            busy = []
            for i in numbers:
                r = mine[i]
                cpu = r["cpu_s"] if label == "all" else r["processes_cpu_s"].get(label, 0.0)
                busy.append(cpu / r["wall_s"])
            rows.append([side, label, *(f"{b:.3f}" for b in busy), f"{statistics.median(busy):.3f}"])
    table: str = format_table(["side", "process", *(f"round {i}" for i in numbers), "median"], rows)
    return table


#: FFN report keys always shown as compact JSON (their key count varies with the load: one row per side).
AS_JSON = ("tokens_per_item", "executors", "overlap", "round_trip_stamps")

#: the rows of the round-trip table after the nine spans: (label, key of breakdown's result)
ROUND_TRIP_ROWS = (
    ("sum of the nine", "sum"),
    ("round trip (on_compute entry to unpacked)", "round trip"),
    ("sends (first isend to sends done, overlaps wire out)", "sends"),
    ("wire out + back (round trip - the other seven)", "wire out + back"),
)


def round_trip_table(data: dict[str, Any]) -> list[str]:
    """Where a round trip goes: a column per AFD side (and Attention engine), the nine spans, their sum, the
    round trip they add up to and the measured one (us); lines to print."""
    columns = [(name, e) for name, engines in data["sides"].items() for e in engines if e["spans_us"] is not None]
    if not columns:
        return ["where a round trip goes: n/a (no Attention engine reported round_trip_stamps: not torch_p2p?)"]
    engines = max(len(engines) for engines in data["sides"].values())
    heads = [name if engines == 1 else f"{name} a{e['engine']}" for name, e in columns]
    rows = [[span, *(_us(e["spans_us"][span]) for _, e in columns)] for span, _, _ in SPANS]
    rows += [[label, *(_us(e["spans_us"][key]) for _, e in columns)] for label, key in ROUND_TRIP_ROWS]
    rows.append(["measured round trip (overlap counters)", *(_us(e["measured_round_trip_us"]) for _, e in columns)])
    items = [e["spans_us"]["items"] for _, e in columns]
    rows.append(
        ["items (Attention / FFN)", *(f"{i['attention']} / {'n/a' if i['ffn'] is None else i['ffn']}" for i in items)]
    )
    title = f"where a round trip goes (us, means over the whole run, {engines}A{data['ffn_ranks']}F)"
    return [
        title,
        format_table(["span", *heads], rows),
        "spans: pack = on_compute entry to the end of _pack; post = to the first isend; wire out = to the FFN's "
        "last frame read (payload Pending done_at); FFN wake-up = to the compute call; FFN compute; FFN pack = "
        "compute return to the combine isend; wire back = to the combine Pending's done_at here; Attention "
        "wake-up = to link.wait's return in CombineInFlight.wait; unpack = to its return "
        "(docs/internals/p2p-transport.md, afd_mrv2.hooks.p2p.stamps)",
        "n/a: the FFN side's stamps are missing or counted other items (wire out / back need both on one host and "
        "one FFN rank); the measured round trip runs from exchange.start (before the executor's queue and "
        "on_recv) to the last combine's arrival (or wait's call, if later), the sum from on_compute's entry to "
        "wait's return",
    ]


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _flat(report: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Small dicts (up to 4 keys) one level deep as dotted keys; other dicts and lists as compact JSON; long texts cut."""
    flat: dict[str, Any] = {}
    for key, value in report.items():
        if isinstance(value, dict) and not prefix and len(value) <= 4 and key not in AS_JSON:
            flat.update(_flat(value, f"{key}.") if value else {key: "{}"})
        elif isinstance(value, dict | list):
            flat[prefix + key] = _short(json.dumps(value, separators=(",", ":")))
        else:
            flat[prefix + key] = _short(value) if isinstance(value, str) else value
    return flat


def _short(text: str, width: int = 70) -> str:
    """Long texts (an end reason) cut for the table; the JSON output keeps them whole."""
    return text if len(text) <= width else text[: width - 3] + "..."


def ffn_table(reports: dict[str, list[dict[str, Any]]], running_s: dict[str, float]) -> str:
    """Every key of every FFN report (a row per key, a column per side and FFN rank), busy fraction first."""
    flats: dict[str, dict[str, Any]] = {}
    for side, entries in reports.items():
        for entry in entries:
            report = entry["report"]
            busy = float(report.get("busy_s", 0.0))
            computed = int(report.get("computed", 0))
            per_item = {int(k): int(v) for k, v in (report.get("tokens_per_item") or {}).items()}
            mean = sum(k * v for k, v in per_item.items()) / max(1, sum(per_item.values()))
            flats[f"{side} ffn {entry['rank']}"] = {
                "busy fraction (busy_s / unpaused s)": f"{busy / max(running_s[side], 1e-9):.4f}",
                "compute ms per item (busy_s / computed)": f"{1000 * busy / computed:.3f}" if computed else "-",
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


def report(result: dict[str, Any]) -> str:
    rounds, sides, ratios, lim = result["rounds"], result["sides"], result["ratios"], result["analytic"]
    n = result["ubatches"]
    paused = max((r["paused_cpu_s"] for r in rounds), default=0.0)
    counts = ", ".join(f"{name}'s {next(r['paused_pids'] for r in rounds if r['side'] == name)}" for name in SIDES)
    lines = [
        "",
        _cores(result),
        "(every process of a server or role is pinned to its cores, vLLM's OpenMP threads bound to them; serve's "
        "supervisor and proxy float)",
        (
            f"every side's EngineCore processes ran at nice {result['engine_core_nice']} (--engine-core-nice)"
            if result.get("engine_core_nice") is not None
            else "EngineCore processes at their default priority (see --engine-core-nice)"
        ),
        f"paused while another side ran: SIGSTOP of every process of the other two sides (processes paused in the "
        f"rounds of each side: {counts}), each checked in state T before every round; their CPU time during a "
        f"round: at most {paused:.3f} s",
        "",
        rounds_table(rounds),
        "",
        "steps: engine steps in the round (AFD sides: the Attention runner's forwards; plain: vLLM's "
        "iteration_tokens_total count); wall ms/step = wall / steps; fwd ms/step = the runner's forward time "
        "summed over the round / steps; rest = the rest of the step (scheduling, input preparation, sampling, "
        "front end); steps by stage count: AFD sides, 1 = unsplit, N = split into N micro-batches",
        "",
        "CPU per process: cores busy = CPU s (user + system, every thread) in the round / round wall s",
        cpu_table(rounds),
        "",
    ]
    rows = []
    for name in SIDES:
        s = sides[name]
        stages = ", ".join(
            f"{k}: {v['median_ms']:.2f} ({v['count']})" for k, v in (s.get("forward_ms_by_stage_count") or {}).items()
        )
        fwd = s.get("forward_ms_per_step")
        rows.append(
            [
                name,
                s["rounds"],
                s["median_tok_s"],
                _ms(s["median_forward_ms"]),
                stages or "-",
                _ms(s["wall_ms_per_step"]),
                _ms(fwd),
                _ms(s.get("rest_ms_per_step")),
                _ms(100 * fwd / s["wall_ms_per_step"] if fwd and s["wall_ms_per_step"] else None, 1),
                s["median_cores_busy"],
            ]
        )
    lines += [
        f"per side over the measured rounds (median tok/s of the rounds; forward: every forward of the rounds, "
        f"measured by the Attention runner; plain: {sides['plain']['forward_ms_note']})",
        format_table(
            [
                "side",
                "rounds",
                "median tok/s",
                "median fwd ms",
                "fwd median ms by stage count (n)",
                "wall ms/step",
                "fwd ms/step",
                "rest ms/step",
                "fwd % of step",
                "median cores busy",
            ],
            rows,
        ),
        "",
        f"ubatch/blocking: tok/s {ratios['ubatch/blocking tok_s']:.3f}, median forward ms "
        f"{_ms(ratios['ubatch/blocking forward_ms'], 3)} (forward speedup {_ms(lim.get('measured_forward_speedup'), 3)})",
        f"ubatch/plain: tok/s {ratios['ubatch/plain tok_s']:.3f} (equal cores: plain pinned to "
        f"{result['cores']['plain']['count']}, ubatch to {sum(c['count'] for c in result['cores'].get('ubatch', {}).values())})",
    ]
    split = sides["ubatch"]["overlap"].get(str(n))
    if split:
        lines.append(
            f"hidden fraction (ubatch side, steps split into {n}, over the measured rounds): hidden "
            f"{split['hidden_total_ms']:.1f} ms / round trips {split['round_trip_total_ms']:.1f} ms = "
            f"{split['hidden_fraction']:.3f} ({split['round_trips']:.0f} round trips, {split['steps']:.0f} steps)"
        )
    else:
        lines.append(f"hidden fraction: n/a (no step of the ubatch side's measured rounds was split into {n})")
    lines += ["", f"analytic limit of the forward speedup: (A + F + 2c) / max({n} a, {n} f, a + f + 2c)"]
    if lim["analytic_limit"] is None:
        lines.append(f"  n/a: {lim['why_not']}")
    else:
        fb, fu = lim["ffn_blocking"], lim["ffn_ubatch"]
        lines += [
            f"  A = {lim['A_ms']:.3f} ms  blocking side: attention compute per MoE layer (overlap['1'].compute_ms "
            "over the measured rounds)",
            f"  F = {lim['F_ms']:.3f} ms  blocking FFN: compute per item (busy_s {fb['busy_s']:.3f} / computed "
            f"{fb['computed']}, whole session; {fb['tokens_per_item']:.1f} tokens per item)",
            f"  a = {lim['a_ms']:.3f} ms  ubatch side: attention compute per micro-batch and MoE layer "
            f"(overlap['{n}'].compute_ms over the measured rounds)",
            f"  f = {lim['f_ms']:.3f} ms  ubatch FFN: compute per item (busy_s {fu['busy_s']:.3f} / computed "
            f"{fu['computed']}, whole session; {fu['tokens_per_item']:.1f} tokens per item)",
            f"  c = {lim['c_ms']:.3f} ms  one transfer = (blocking round trip {lim['blocking_round_trip_ms']:.3f} ms "
            f"- F) / 2{'  (negative: the round trip is shorter than F)' if lim['c_ms'] < 0 else ''}",
            f"  limit = {lim['numerator_ms']:.3f} / max("
            + ", ".join(f"{k} {v:.3f}" for k, v in lim["terms_ms"].items())
            + f") = {lim['analytic_limit']:.3f} (bound by {lim['bound_by']})",
            f"  measured forward speedup (blocking / ubatch median forward ms) = "
            f"{_ms(lim['measured_forward_speedup'], 3)}: {_ms(lim['fraction_of_limit'], 3)} of the limit",
            f"  the same computes with a faster transport: {lim['limit_free_transport']:.3f} with a free one "
            f"(2c = 0), {lim['limit_at_overhead_bar']:.3f} at 2c = {OVERHEAD_BAR_MS:g} ms (per MoE layer; a "
            "forward also fills and drains the pipeline once)",
        ]
        if lim["forward_bound"] is not None:
            lines.append(
                f"  a whole forward as a schedule ({lim['moe_layers']} MoE layers, {n} micro-batches, filled and "
                f"drained once): {lim['forward_bound']:.3f} with this c, {lim['forward_bound_free_transport']:.3f} "
                "with a free transport"
            )
    lines += ["", *round_trip_table(result["round_trip"]), ""]
    if any(result["ffn_reports"].values()):
        lines += [
            f"FFN side: each role's 'afd-mrv2 ffn: done' report after SIGTERM (serve exit {result['serve_exit']}); "
            "busy fraction over the side's unpaused time from ready to stop (warm-up and idle time included)",
            ffn_table(result["ffn_reports"], result["running_s"]),
        ]
    else:
        lines.append(f"FFN side: no 'afd-mrv2 ffn: done' report in serve's logs (serve exit {result['serve_exit']})")
    checks = []
    for name in ("blocking", "ubatch"):
        s = sides[name]
        if s.get("forwards_lost"):
            checks.append(f"{name}: {s['forwards_lost']} forwards beyond the runner's kept window (not in the medians)")
        if s.get("failed_steps"):
            checks.append(f"{name}: {s['failed_steps']} failed steps")
        if s.get("steps_metric") is not None and s["steps_metric"] != s["steps"]:
            checks.append(f"{name}: runner forwards {s['steps']} != vLLM's step count {s['steps_metric']}")
    load = result["load_average"]
    lines += [
        "",
        *(f"check: {c}" for c in checks),
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
