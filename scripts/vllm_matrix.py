#!/usr/bin/env python3
"""The equivalence matrix: ``afd-mrv2 serve`` against plain vLLM, per architecture x runner x topology.

    .venv-vllm/bin/python scripts/vllm_matrix.py [--archs mixtral deepseek_v2] [--configs 1a1f 1a1f-d2 2a1f 2a2f]
        [--runners v1 v2] [--transport gloo|zmq|tcp] [--json OUT] [--models DIR] [-- ENGINE ARGS]

For each architecture (a checkpoint made with ``afd-mrv2 make-model DIR --arch ARCH``) and runner,
one plain vLLM OpenAI server answers 32 greedy completions of 16 tokens (sent at once, ``logprobs:
1``, ``return_token_ids: true``) twice (plain vs plain: the run-to-run figure), then is stopped;
then for each config one ``afd-mrv2 serve`` with that topology answers the same 32 requests and is
stopped with SIGTERM.  Each row: identical completions / 32, differing tokens and the largest
|logprob| difference vs plain, beside plain vs plain, and the verdict:

    1A1F (any depth)  PASS when 32/32 token-identical and max |logprob diff| <= 1e-5
    2A1F, 2A2F        PASS when >= 31/32 identical and max |logprob diff| <= 1e-4
    *-ub2             micro-batched (serve --ubatches 2, token thresholds 2: every step of two tokens
                      or more split), V2 runner only: PASS when >= 31/32 identical, max diff <= 1e-4

The micro-batched configs (``1a1f-ub2``, ``2a2f-ub2``) run only when named in ``--configs``;
on the v1 runner they are "not available" (micro-batching runs on Model Runner V2).

A config serve refuses or fails on is FAILED with serve's one-line error, and the matrix goes
on.  A runner whose harness is missing (or that vLLM did not use) is "not available: <why>".
Exit 0 when every row passed, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serving import ENGINE_ARGS, ServerError, UsageError, check_vllm, guarded, load_average, write_json
from serving.matrix import (
    ARCH_ENGINE_ARGS,
    ARCHS,
    COMPLETIONS,
    CONFIGS,
    DEFAULT_CONFIGS,
    RUNNERS,
    TOKENS,
    RunnerUnavailable,
    make_model,
    plain_reference,
    serve_row,
    verdict,
)

from afd_mrv2.config import TRANSPORTS
from afd_mrv2.table import format_table

PROG = "vllm_matrix"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    head, engine = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, ENGINE_ARGS)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--archs", nargs="+", default=["mixtral", "deepseek_v2"], metavar="ARCH", help=f"of {ARCHS}")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=DEFAULT_CONFIGS,
        metavar="CONFIG",
        help=f"of {list(CONFIGS)} (default: the unsplit ones)",
    )
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), metavar="RUNNER", help=f"of {list(RUNNERS)}")
    parser.add_argument(
        "--transport", choices=TRANSPORTS, default="gloo", help="serve --transport: what the pairs run on (%(default)s)"
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    parser.add_argument("--models", default="out/vllm-matrix/models", help="checkpoints folder (default %(default)s)")
    parser.add_argument("--logs", default="out/vllm-matrix/logs", help="servers' logs folder (default %(default)s)")
    args = parser.parse_args(head)
    for name, values, known in (("archs", args.archs, ARCHS), ("configs", args.configs, CONFIGS)):
        bad = [v for v in values if v not in known]
        if bad:
            raise UsageError(f"--{name}: expected some of {', '.join(known)}, got {', '.join(bad)}")
    bad = [v for v in args.runners if v not in RUNNERS]
    if bad:
        raise UsageError(f"--runners: expected some of {', '.join(RUNNERS)}, got {', '.join(bad)}")
    return args, list(engine)


#: Takes each row as it is decided (kept and printed).
AddRow = Callable[[dict[str, Any]], None]


def _config_row(
    model: Path,
    runner_name: str,
    config_name: str,
    args_here: list[str],
    logs: Path,
    reference: dict[str, Any],
    transport: str = "gloo",
) -> dict[str, Any]:
    """One config served on one runner, compared with plain vLLM's answers (``reference``: arch, runner, plain,
    plain_vs_plain, plain_ready_s)."""
    config = CONFIGS[config_name]
    base = {"arch": reference["arch"], "runner": runner_name, "config": config_name, "transport": transport}
    if config.topology.ubatches is not None and runner_name != "v2":
        return {**base, "verdict": "not available: micro-batching runs on V2"}
    row: dict[str, Any] = {**base, "plain_ready_s": reference["plain_ready_s"]}
    row["plain_vs_plain"] = reference["plain_vs_plain"]
    name = f"{reference['arch']}-{runner_name}-{config_name}"
    try:
        flags = ("--transport", transport)
        row.update(serve_row(model, config, RUNNERS[runner_name], args_here, logs, name, reference["plain"], flags))
        row["verdict"] = verdict(config, row)
    except RunnerUnavailable as exc:
        row["verdict"] = f"not available: {exc}"
    except ServerError as exc:
        row["verdict"] = f"FAILED: {exc}"
    if row.get("residual_pids"):
        row["verdict"] += f" (left processes {row['residual_pids']})"
    return row


def _runner_rows(
    arch: str, model: Path, runner_name: str, args: argparse.Namespace, engine_args: list[str], add: AddRow
) -> None:
    """Plain vLLM's reference on one runner, then every config against it."""
    runner = RUNNERS[runner_name]
    base = {"arch": arch, "runner": runner_name}
    args_here = [*engine_args, *runner.engine_args, *ARCH_ENGINE_ARGS.get(arch, ())]
    logs = Path(args.logs)
    try:
        why = runner.missing()
        if why is not None:
            raise RunnerUnavailable(why)
        plain, plain_vs_plain, plain_ready = plain_reference(model, runner, args_here, logs, f"{arch}-{runner_name}")
    except (RunnerUnavailable, ServerError) as exc:
        state = "not available" if isinstance(exc, RunnerUnavailable) else "FAILED: plain vLLM"
        for config_name in args.configs:
            add({**base, "config": config_name, "verdict": f"{state}: {exc}"})
        return
    reference = {"arch": arch, "plain": plain, "plain_vs_plain": plain_vs_plain, "plain_ready_s": plain_ready}
    for config_name in args.configs:
        add(_config_row(model, runner_name, config_name, args_here, logs, reference, args.transport))


def run(args: argparse.Namespace, engine_args: list[str]) -> list[dict[str, Any]]:
    check_vllm()
    models = Path(args.models)
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"  {row['arch']:<12} {row['runner']:<3} {row['config']:<8} {row['verdict']}", flush=True)

    for arch in args.archs:
        try:
            model = make_model(models / arch, arch)
        except (ServerError, UsageError) as exc:
            for runner_name in args.runners:
                for config_name in args.configs:
                    add({"arch": arch, "runner": runner_name, "config": config_name, "verdict": f"FAILED: {exc}"})
            continue
        for runner_name in args.runners:
            _runner_rows(arch, model, runner_name, args, engine_args, add)
    return rows


def report(rows: list[dict[str, Any]], engine_args: list[str], load: dict[str, Any]) -> str:
    def diff(x: Any) -> str:
        return f"{x:.1e}" if isinstance(x, float) else "-"

    table = []
    for r in rows:
        pp = r.get("plain_vs_plain", {})
        items = "+".join(str(d["report"].get("items", "?")) for d in r.get("ffn_reports", [])) or "-"
        table.append(
            [
                r["arch"],
                r["runner"],
                r["config"],
                f"{r['identical']}/{r['completions']}" if "identical" in r else "-",
                f"{r['differing']}/{r['tokens']}" if "differing" in r else "-",
                diff(r.get("max_logprob_diff")),
                f"{pp['identical']}/{pp['completions']}" if pp else "-",
                diff(pp.get("max_logprob_diff")),
                f"{r['ready_s']:.0f}" if "ready_s" in r else "-",
                items,
                r["verdict"],
            ]
        )
    headers = [
        "arch",
        "runner",
        "config",
        "identical",
        "tokens differ",
        "max |dlogprob|",
        "plain/plain",
        "plain/plain max",
        "ready s",
        "ffn items",
        "verdict",
    ]
    return "\n".join(
        [
            "",
            f"{COMPLETIONS} greedy completions x {TOKENS} tokens, sent at once, vs plain vLLM on the same checkpoint; "
            f"engine args: {' '.join(engine_args)}",
            format_table(headers, table),
            "",
            "identical / tokens differ / max |dlogprob|: serve vs plain (|dlogprob| over the identical completions); "
            "plain/plain: the plain server asked twice; ffn items: per FFN rank, from its 'afd-mrv2 ffn: done' report",
            f"load average (1/5/15 min): start {' '.join(f'{x:.2f}' for x in load['start'])}, "
            f"end {' '.join(f'{x:.2f}' for x in load['end'])}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parsed = guarded(PROG, lambda: parse_args(list(sys.argv[1:] if argv is None else argv)))
    if isinstance(parsed, int):
        return parsed
    args, engine_args = parsed
    load_start = load_average()
    print(
        f"{PROG}: archs {' '.join(args.archs)}, runners {' '.join(args.runners)}, configs {' '.join(args.configs)}, "
        f"serve --transport {args.transport}"
    )
    rows = guarded(PROG, lambda: run(args, engine_args))
    if isinstance(rows, int):
        return rows
    load = {"start": load_start, "end": load_average()}
    print(report(rows, engine_args, load))
    print(f"took {time.monotonic() - started:.0f} s")
    doc = {"engine_args": engine_args, "completions": COMPLETIONS, "tokens": TOKENS, "load_average": load}
    write_json(args.json, {**doc, "rows": rows})
    return 0 if all(r["verdict"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
