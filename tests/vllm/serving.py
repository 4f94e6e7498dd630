"""Real ``afd-mrv2 serve`` and plain vLLM OpenAI servers for tests/vllm (child processes, stopped by the fixtures).

* :class:`Serve`: ``afd-mrv2 serve MODEL --attention 1 --ffn 1 --port P -- ENGINE ARGS``
  (stdout read for the ready line, stderr to a log file);
* :class:`PlainServer`: ``python -m vllm.entrypoints.openai.api_server`` on the same
  checkpoint with the same engine arguments and no ``afd`` section;
* :func:`complete` / :func:`stream` / :func:`complete_all`: OpenAI completions over HTTP;
* :func:`greedy_answers`: the 16 greedy prompts of tests/vllm/engine.py at once, as :func:`compare` takes them.

Both servers get the engine arguments :data:`ENGINE_ARGS` (fp32 like tests/vllm/engine.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from afd_mrv2.serve.client import LineReader, complete, greedy
from afd_mrv2.serve.client import body as body  # re-exported for the tests
from afd_mrv2.serve.client import compare as compare
from tests.dists import write_dist_info
from tests.vllm.engine import PROMPTS
from tests.vllm.harness import BASE_ENV, cores

ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16", "--seed", "0"]
READY = "afd-mrv2 serve: ready at"
START_TIMEOUT_S = 600


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # serve pins its roles itself
    env.update(extra or {})
    return env


class Serve:
    """``afd-mrv2 serve`` as a child process (its own process group)."""

    def __init__(
        self,
        model: Path,
        port: int,
        log: Path,
        *args: str,
        extra: list[str] | None = None,
        attention: int = 1,
        ffn: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.log = log
        exe = Path(sys.executable).with_name("afd-mrv2")
        cmd = [str(exe), "serve", str(model), "--attention", str(attention), "--ffn", str(ffn), "--port", str(port)]
        cmd += [*args, "--", *(ENGINE_ARGS if extra is None else extra)]
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=_env(env), start_new_session=True
        )
        self._out = LineReader(self.proc.stdout)  # type: ignore[arg-type]

    @property
    def stdout(self) -> list[str]:
        """serve's stdout lines so far (exactly one, the ready line, once it is ready)."""
        return self._out.lines

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds from the start to the ready line; raises with the log's tail if it does not come."""
        if not self._out.wait_for(READY, deadline=self.started + timeout_s, alive=lambda: self.proc.poll() is None):
            raise AssertionError(f"serve not ready (exit {self.proc.poll()}):\n{self.log_text()[-4000:]}")
        return time.monotonic() - self.started

    def log_text(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def role_pid(self, name: str) -> int:
        """The pid serve started for role ``name`` (``ffn 0``), from its ``[ffn 0] started pid N:`` line."""
        for line in self.log_text().splitlines():
            prefix = f"[{name}] started pid "
            if line.startswith(prefix):
                return int(line[len(prefix) :].split(":", 1)[0])
        raise AssertionError(f"no start line for {name}")

    def wait_exit(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> int | None:
        """SIGTERM (then SIGKILL the whole group after 30 s); returns the exit code."""
        _terminate(self.proc, lambda: self.proc.send_signal(signal.SIGTERM))
        self._log_file.close()
        return self.proc.returncode


class PlainServer:
    """Plain vLLM's OpenAI server (afd-mrv2 installed, no ``afd`` section) on one core."""

    def __init__(self, model: Path, port: int, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS, *args]
        env = _env({**BASE_ENV, "VLLM_CPU_OMP_THREADS_BIND": cores()[0], **(env or {})})
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"plain server exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError("plain server not ready in time")

    def stop(self) -> None:
        _terminate(self.proc, lambda: os.killpg(self.proc.pid, signal.SIGTERM))
        self._log_file.close()


def _terminate(proc: subprocess.Popen[bytes], term: Callable[[], None]) -> None:
    """If ``proc`` runs: ``term()``, then SIGKILL its whole process group after 30 s."""
    if proc.poll() is None:
        term()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


THIRD_PARTY = Path(__file__).with_name("thirdparty")


def third_party_site(folder: Path, module: str, connector: str, factory: str) -> Path:
    """A site folder holding a TEST-ONLY distribution, installed the way any third party installs a connector:
    ``tests/vllm/thirdparty/<module>.py`` and its dist-info declaring ``[afd_mrv2] connector = module:factory``."""
    folder.mkdir(parents=True)
    shutil.copy(THIRD_PARTY / f"{module}.py", folder / f"{module}.py")
    write_dist_info(folder, module, "0.0.0", {"afd_mrv2": {connector: f"{module}:{factory}"}})
    return folder


def with_site(site: Path) -> dict[str, str]:
    """The ``PYTHONPATH`` of this environment with ``site`` first (for a child's environment)."""
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}


#: vLLM's dev endpoints (``POST /collective_rpc``): what the tests read from inside the workers.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


def rpc(url: str, method: str, timeout: float = 60) -> list[Any]:
    """``collective_rpc(method)`` on the vLLM OpenAI server at ``url`` (needs :data:`DEV_MODE`); one result per worker."""
    req = urllib.request.Request(
        url + "/collective_rpc", json.dumps({"method": method}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return list(json.loads(resp.read())["results"])


def ffn_reports(log_text: str) -> dict[int, dict[str, Any]]:
    """Each FFN rank's ``afd-mrv2 ffn: done {...}`` report, from serve's log (rank -> report)."""
    found: dict[int, dict[str, Any]] = {}
    for line in log_text.splitlines():
        if line.startswith("[ffn ") and "] afd-mrv2 ffn: done " in line:
            rank = int(line[len("[ffn ") : line.index("]")])
            found[rank] = json.loads(line.split("] afd-mrv2 ffn: done ", 1)[1])
    return found


def stream(
    url: str, payload: dict[str, Any], timeout: float = 300, first: threading.Event | None = None
) -> tuple[int, list[Any]]:
    """POST a ``"stream": true`` completion; (status, events): each ``data:`` payload parsed, ``[DONE]`` as is."""
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps({**payload, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    events: list[Any] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if first is not None:
                    first.set()
    except urllib.error.HTTPError as exc:
        return exc.code, [exc.read().decode(errors="replace")]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return -1, [*events, f"{type(exc).__name__}: {exc}"]
    return status, events


def complete_all(url: str, payloads: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any] | str]]:
    """Every payload at once, one client thread each."""
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(lambda p: complete(url, p), payloads))


def greedy_payloads(model: Path, max_tokens: int = 12) -> list[dict[str, Any]]:
    """One greedy request per prompt of tests/vllm/engine.py, asking for what :func:`greedy` reads."""
    return [body(model, p, max_tokens, logprobs=1, return_token_ids=True) for p in PROMPTS]


def greedy_answers(url: str, model: Path, max_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    """:func:`greedy_payloads` sent concurrently to ``url``; every answer must be a 200."""
    answers = complete_all(url, greedy_payloads(model, max_tokens))
    assert all(status == 200 for status, _ in answers), answers
    return [greedy(a) for _, a in answers]  # type: ignore[arg-type]
