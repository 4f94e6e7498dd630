"""Real vLLM engines for tests/vllm: each engine is a subprocess (a fresh vLLM per engine).

* :func:`make_model`: a ``afd-mrv2 make-model`` checkpoint;
* :func:`run_engines`: one or more :mod:`tests.vllm.engine` runs at once, each pinned
  to its own core (``VLLM_CPU_OMP_THREADS_BIND``), results read back as JSON;
* :class:`FfnRole`: ``python -m afd_mrv2.mrv2.ffn.role`` started before the Attention
  engine, its ``ready`` / ``done`` lines parsed.

Environment for every engine: ``HF_HUB_OFFLINE=1`` (nothing is downloaded) and
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB).  On a 2-core machine vLLM's automatic thread
binding puts every engine on core 0; the two engines of a pair are pinned apart.

Runners: an engine runs vLLM's V1 CPU runner (the default) unless its environment
comes from :func:`v2_env`: ``VLLM_USE_V2_MODEL_RUNNER=1`` plus the TEST-ONLY triton
stand-in (:data:`TRITON_STANDIN`, on ``PYTHONPATH``, with ``TRITON_INTERPRET=1``) that
vLLM's Model Runner V2 needs on vllm-cpu; V2 engines run eager (:data:`V2_ENGINE_ARGS`).
The V2 variables are removed from every other engine's environment, so a developer's
shell cannot turn the V1 runs into V2 ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.serving import BASE_ENV as BASE_ENV  # re-exported for the tests
from scripts.serving import compare as compare_greedy
from tests.dists import write_dist_info

ENGINE = Path(__file__).with_name("engine.py")
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 16, "seed": 0}
ENGINE_TIMEOUT_S = 600
ZERO_PLUGIN = "afd_mrv2_test_zero"  # tests/vllm/thirdparty/afd_mrv2_test_zero.py: routed experts give zeros
TRITON_STANDIN = Path(__file__).with_name("triton_cpu_standin")  # its sitecustomize.py; see its docstring
STANDIN_ENV = "AFD_MRV2_TEST_TRITON_CPU_STANDIN"  # triton_cpu_standin/sitecustomize.py STANDIN_ENV
V2_KEYS = ("VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET", STANDIN_ENV)
#: V2 on CPU runs eager (with the stand-in Inductor would look for a triton CPU target)
V2_ENGINE_ARGS = {"enforce_eager": True}
#: the Attention engine's worker: upstream's CPUWorker whose init_device installs afd-mrv2's runner under V2
AFD_WORKER = {"worker_cls": "afd_mrv2.mrv2.attention.worker.AfdWorker"}
V2_RUNNER = "vllm.v1.worker.cpu.model_runner.CPUModelRunner"  # vLLM's Model Runner V2 on CPU
V1_RUNNER = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"  # vLLM's default CPU runner


def v2_env() -> dict[str, str]:
    """The environment additions that select Model Runner V2 on vllm-cpu (test-only triton stand-in)."""
    if not (TRITON_STANDIN / "sitecustomize.py").is_file():
        raise AssertionError(f"the triton stand-in is missing: {TRITON_STANDIN / 'sitecustomize.py'}")
    path = os.pathsep.join(p for p in (str(TRITON_STANDIN), os.environ.get("PYTHONPATH", "")) if p)
    return {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", STANDIN_ENV: "1", "PYTHONPATH": path}


def cores() -> tuple[str, str]:
    """Two CPU ids to pin a pair of engines to (the same one twice on a 1-core machine)."""
    available = sorted(os.sched_getaffinity(0))
    return str(available[0]), str(available[-1])


def make_model(folder: Path, arch: str) -> Path:
    cmd = [sys.executable, "-m", "afd_mrv2.cli", "make-model", str(folder), "--arch", arch]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return folder


@dataclass
class EngineRun:
    """One engine.py run to start: its output file, afd section and extra environment."""

    name: str
    afd: dict[str, Any] | None = None
    env: dict[str, str] | None = None
    engine_args: dict[str, Any] | None = None  # added to engine.py's ENGINE_ARGS


def zero_env(folder: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` plus what installs the TEST-ONLY zero-experts vLLM plugin into one run: its own dist-info first on
    ``PYTHONPATH``, and ``VLLM_PLUGINS`` naming it alone (afd-mrv2's plugin stays out of that run)."""
    site = folder / "zero-plugin-site"
    site.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).with_name("thirdparty") / f"{ZERO_PLUGIN}.py"
    (site / source.name).write_text(source.read_text())
    write_dist_info(site, ZERO_PLUGIN, "0.0.0", {"vllm.general_plugins": {ZERO_PLUGIN: f"{ZERO_PLUGIN}:register"}})
    env = dict(env or {})
    paths = [str(site), *filter(None, env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")).split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(paths), "VLLM_PLUGINS": ZERO_PLUGIN}


def _env(extra: dict[str, str] | None, core: str) -> dict[str, str]:
    env = {**os.environ, **BASE_ENV, "VLLM_CPU_OMP_THREADS_BIND": core}
    for key in (*V2_KEYS, "VLLM_PLUGINS"):  # the test-only switches reach only the runs that ask for them
        env.pop(key, None)
    env.update(extra or {})
    return env


def run_engines(
    model: Path, out_dir: Path, runs: list[EngineRun], *, core_list: list[str] | None = None
) -> dict[str, Any]:
    """Run ``runs`` concurrently (one core each); returns name -> the engine's JSON report."""
    core_list = core_list or list(cores())
    procs = []
    for i, run in enumerate(runs):
        out, log = out_dir / f"{run.name}.json", out_dir / f"{run.name}.log"
        cmd = [sys.executable, str(ENGINE), str(model), str(out)]
        if run.afd is not None:
            cmd += ["--afd", json.dumps(run.afd)]
        if run.engine_args:
            cmd += ["--engine-args", json.dumps(run.engine_args)]
        with open(log, "w") as f:
            procs.append(
                (
                    run,
                    out,
                    log,
                    subprocess.Popen(
                        cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(run.env, core_list[i % len(core_list)])
                    ),
                )
            )
    reports = {}
    for run, out, log, proc in procs:
        try:
            code = proc.wait(ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code != 0:
            tail = log.read_text()[-3000:]
            raise AssertionError(f"engine {run.name!r} exited {code}; log {log} ends:\n{tail}")
        reports[run.name] = json.loads(out.read_text())
    return reports


class FfnRole:
    """An FFN role process (``python -m afd_mrv2.mrv2.ffn.role``), started and waited for."""

    def __init__(
        self,
        model: Path,
        afd: dict[str, Any],
        log: Path,
        core: str,
        *,
        env: dict[str, str] | None = None,
        engine_args: dict[str, Any] | None = None,
        new_session: bool = False,
    ) -> None:
        self.log = log
        self.started = time.monotonic()
        self.ready_s: float | None = None
        cmd = [sys.executable, "-m", "afd_mrv2.mrv2.ffn.role", str(model), "--afd", json.dumps(afd)]
        cmd += ["--engine-args", json.dumps({**ENGINE_ARGS, **(engine_args or {})})]
        self._file = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cmd, stdout=self._file, stderr=subprocess.STDOUT, env=_env(env, core), start_new_session=new_session
        )

    def wait_ready(self, timeout_s: float = ENGINE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "afd-mrv2 ffn: ready" in self.log.read_text():
                self.ready_s = time.monotonic() - self.started
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"FFN role exited {self.proc.returncode} before ready:\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(1)
        raise AssertionError(f"FFN role not ready within {timeout_s} s")

    def wait(self, timeout_s: float = 120) -> dict[str, Any]:
        """Wait for the FFN role to end (its Attention engine left); returns its report."""
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._file.close()
        text = self.log.read_text()
        done = [line for line in text.splitlines() if line.startswith("afd-mrv2 ffn: done ")]
        assert code == 0 and done, f"FFN role exited {code} without a report:\n{text[-3000:]}"
        return json.loads(done[-1].removeprefix("afd-mrv2 ffn: done "))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._file.close()


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Greedy results of two engine reports side by side (:func:`scripts.serving.compare`)."""
    ra, rb = a["results"], b["results"]
    assert [r["prompt"] for r in ra] == [r["prompt"] for r in rb]
    return compare_greedy([(r["tokens"], r["logprobs"]) for r in ra], [(r["tokens"], r["logprobs"]) for r in rb])


def afd_section(role: str, port: int) -> dict[str, Any]:
    """The ``afd`` section of a 1A1F engine pair on ``port``."""
    return {"connector": "torch_p2p", "role": role, "port": port, "compute_gate_on_attention": True}


def assert_identical(result: dict[str, Any], max_logprob_diff: float = 1e-5) -> None:
    """Every completion token-identical, logprobs within ``max_logprob_diff``."""
    assert result["identical"] == result["completions"], result
    assert result["max_logprob_diff"] <= max_logprob_diff, result


def assert_experts_on_ffn_and_every_call_served(runs: dict[str, Any]) -> None:
    """From inside the worker processes (collective_rpc): the Attention engine holds no routed-expert
    bytes, the FFN role exactly plain vLLM's and nothing else (its experts-only model, no KV cache beyond
    the scheduler's null block), and every MoE call of the Attention engine (warm-up included) was one FFN
    item, whole forwards only."""
    afd, ffn = runs["afd"], runs["ffn"]
    assert afd["routed_expert_bytes"] == 0
    assert ffn["routed_expert_bytes"] == runs["plain"]["routed_expert_bytes"] > 0
    assert ffn["model_class"] == "AfdFfnExperts" and ffn["kv_cache_blocks"] == 1, ffn
    assert ffn["memory"]["resident_bytes"] == {"routed_experts": ffn["routed_expert_bytes"], "other": 0}, ffn
    stats = afd["afd_stats"]
    assert stats is not None and stats["calls"] > 0
    assert ffn["items"] == stats["calls"]
    assert ffn["items"] % ffn["moe_layers"] == 0
