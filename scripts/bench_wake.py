#!/usr/bin/env python3
"""How long a tcp pair's message waits to be read after ms of compute, per ``AFD_MRV2_TCP_SPIN`` mode, in one run.

    .venv/bin/python scripts/bench_wake.py [--modes off,short,on] [--iters 400] [--warmup 40] [--rounds 3]
        [--attention-ms 2] [--ffn-ms 5] [--kib 16] [--cores A,F] [--json OUT]

serve's waits are long: the FFN rank waits for the next dispatch while the Attention side computes, the
Attention side for the combine while the FFN rank computes.  Here two processes, each pinned to one core
(``--cores``; default the first two this process may run on), play that loop on one tcp pair
(``tcp_channel.loopback_pair``): the Attention side computes ``--attention-ms`` (a matmul loop, one thread),
sends ``--kib`` KiB stamped with ``time.perf_counter`` (one clock for both processes of a host), and waits for
the combine; the FFN side waits for it, computes ``--ffn-ms`` and answers, stamped the same way.  A message's
*delivery* is stamp -> its wait returned: the post, the kernel, and the reader's wake-up.

Each round runs every mode once, in the order given, on a new pair (the mode is read when a channel is made);
rounds repeat the order, so a host whose speed drifts shifts all modes alike.  Prints per mode the p50 and p90
(us) of both deliveries over all rounds, and the CPU seconds per round trip of each side, then each mode's p50
against the first mode's.  Exit 0 after a run, 1 when a side failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from afd_mrv2.hooks.p2p import tcp_channel
from afd_mrv2.hooks.p2p.channel import Pending

MODES = ("off", "short", "on")
_DISPATCH, _COMBINE = 1, 2


class UsageError(Exception):
    """Bad input: one line, exit 2."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_wake", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="AFD_MRV2_TCP_SPIN modes, in order")
    parser.add_argument("--iters", type=int, default=400, help="timed round trips per mode and round")
    parser.add_argument("--warmup", type=int, default=40, help="untimed round trips before them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention-ms", type=float, default=2.0, help="compute before each dispatch")
    parser.add_argument("--ffn-ms", type=float, default=5.0, help="compute before each combine")
    parser.add_argument("--kib", type=int, default=16, help="message size (KiB)")
    parser.add_argument("--cores", help="A,F: the two cores (default: the first two this process may use)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if not args.modes or unknown:
        raise UsageError(f"--modes: each of {', '.join(MODES)}, got {','.join(unknown) or 'none'}")
    for name, value in (("iters", args.iters), ("rounds", args.rounds), ("kib", args.kib)):
        if value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    if args.warmup < 0 or args.attention_ms < 0 or args.ffn_ms < 0:
        raise UsageError("--warmup, --attention-ms and --ffn-ms must be >= 0")
    args.cores = _cores(args.cores)
    return args


def _cores(text: str | None) -> tuple[int, int]:
    allowed = sorted(os.sched_getaffinity(0))
    if text is None:
        if len(allowed) < 2:
            raise UsageError(f"two cores needed, this process may use {allowed}")
        return allowed[0], allowed[1]
    try:
        a, f = (int(c) for c in text.split(","))
    except ValueError:
        raise UsageError(f"--cores: two core numbers A,F, got {text!r}") from None
    if a == f or not {a, f} <= set(allowed):
        raise UsageError(f"--cores: two different cores among {allowed}, got {text!r}")
    return a, f


def _burn(ms: float, x: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x.copy_((x @ x).tanh_())


def _wait(pending: Pending) -> None:
    while not pending.await_done(0.05):
        pass
    if pending.error is not None:
        raise pending.error


def _side(channel: Any, first: bool, args: argparse.Namespace, core: int, write: Any) -> None:
    """One side's loop (the Attention side when ``first``); writes its deliveries and CPU seconds as JSON."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    message = torch.zeros(args.kib * 1024 // 8, dtype=torch.float64)
    work = torch.randn(128, 128) / 128
    compute_ms, send_tag, recv_tag = (
        (args.attention_ms, _DISPATCH, _COMBINE) if first else (args.ffn_ms, _COMBINE, _DISPATCH)
    )
    deliveries, cpu = [], 0.0
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            cpu = time.process_time()
        if first or i:  # the FFN side answers what it received; the Attention side starts
            _burn(compute_ms, work)
            message[0] = time.perf_counter()
            _wait(channel.post("send", message, send_tag, "a message"))
        pending = channel.post("recv", message, recv_tag, "a message")
        _wait(pending)
        if i >= args.warmup:
            deliveries.append(time.perf_counter() - message[0].item())
    if not first:  # the last answer
        _burn(compute_ms, work)
        message[0] = time.perf_counter()
        _wait(channel.post("send", message, send_tag, "a message"))
    write.write(json.dumps({"deliveries": deliveries, "cpu_per_trip": (time.process_time() - cpu) / args.iters}))


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's round: the two sides as forked processes on one new pair; their results."""
    os.environ["AFD_MRV2_TCP_SPIN"] = mode
    attention, ffn = tcp_channel.loopback_pair(name=f"wake-{mode}")
    results: dict[str, Any] = {}
    children = []
    for first, channel, core in ((True, attention, args.cores[0]), (False, ffn, args.cores[1])):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                with os.fdopen(write, "w") as out:
                    _side(channel, first, args, core, out)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        children.append(("attention" if first else "ffn", pid, read))
    for side, pid, read in children:
        with os.fdopen(read) as got:
            text = got.read()
        _, status = os.waitpid(pid, 0)
        if status or not text:
            raise RuntimeError(f"the {side} side of mode {mode} failed (wait status {status})")
        results[side] = json.loads(text)
    for channel in (attention, ffn):
        channel.close()
    return results


def summarize(modes: list[str], rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: p50 / p90 (us) of each side's deliveries over every round, median CPU ms per round trip."""
    summary: dict[str, Any] = {}
    for mode in modes:
        row: dict[str, Any] = {}
        for side, waits_for in (("ffn", "dispatch"), ("attention", "combine")):
            got = sorted(d for r in rounds for d in r[mode][side]["deliveries"])
            row[f"{waits_for}_p50_us"] = statistics.median(got) * 1e6
            row[f"{waits_for}_p90_us"] = got[int(0.9 * (len(got) - 1))] * 1e6
            row[f"{side}_cpu_ms_per_trip"] = statistics.median(r[mode][side]["cpu_per_trip"] for r in rounds) * 1e3
        summary[mode] = row
    return summary


def report(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    lines = [
        f"bench_wake: tcp pair, {args.kib} KiB each way, Attention computes {args.attention_ms:g} ms, FFN "
        f"{args.ffn_ms:g} ms; cores {args.cores[0]},{args.cores[1]}; {args.rounds} rounds x {args.iters} "
        f"round trips per mode (after {args.warmup})",
        f"{'mode':>6}  {'dispatch p50':>12}  {'p90':>6}  {'combine p50':>11}  {'p90':>6}  "
        f"{'A cpu ms/trip':>13}  {'F cpu ms/trip':>13}",
    ]
    for mode, row in summary.items():
        lines.append(
            f"{mode:>6}  {row['dispatch_p50_us']:>12.0f}  {row['dispatch_p90_us']:>6.0f}  "
            f"{row['combine_p50_us']:>11.0f}  {row['combine_p90_us']:>6.0f}  "
            f"{row['attention_cpu_ms_per_trip']:>13.3f}  {row['ffn_cpu_ms_per_trip']:>13.3f}"
        )
    base, first = next(iter(summary.values())), next(iter(summary))
    for mode, row in list(summary.items())[1:]:
        lines.append(
            f"{mode} / {first} at p50: dispatch {row['dispatch_p50_us'] / base['dispatch_p50_us']:.2f}, "
            f"combine {row['combine_p50_us'] / base['combine_p50_us']:.2f}"
        )
    lines.append("delivery: the sender's stamp (before its post) -> the receiver's wait returned, in us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"bench_wake: error: {exc}", file=sys.stderr)
        return 2
    try:
        rounds = [{mode: run_mode(mode, args) for mode in args.modes} for _ in range(args.rounds)]
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"bench_wake: {exc}", file=sys.stderr)
        return 1
    summary = summarize(args.modes, rounds)
    print(report(args, summary))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"}, "modes": summary}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
