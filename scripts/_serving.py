"""Shared by scripts/bench_serve.py and scripts/vllm_matrix.py: servers, clients, comparison.

* :class:`PlainServer`: plain vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
  as a child process group, pinned with ``VLLM_CPU_OMP_THREADS_BIND``;
* :class:`ServeServer`: ``afd-mrv2 serve MODEL --attention A --ffn F ...`` (stdout read for the ready
  line, stderr to a log file; the FFN roles' ``afd-mrv2 ffn: done {...}`` reports read back from it);
* :func:`run_requests`: R completions from C concurrent clients, timed;
* :meth:`Child.pause` / :meth:`Child.resume`: SIGSTOP / SIGCONT of every process of a server's tree
  (checked: each in state ``T``), :meth:`Child.processes` / :func:`process_cpu`: each process by role
  and kind (``APIServer``, ``EngineCore``, ``Worker``, ...) and its CPU seconds;
* :func:`collective_rpc` / :func:`engine_steps`: a vLLM server's ``POST /collective_rpc`` (needs
  ``VLLM_SERVER_DEV_MODE=1``) and its engine-step count (``vllm:iteration_tokens_total``, ``GET /metrics``);
* :func:`greedy` / :func:`compare`: token ids and logprobs of greedy answers, and their comparison.

Every child runs in a session of its own (so Ctrl-C in the terminal reaches only the script,
which stops them) and gets ``PR_SET_PDEATHSIG`` (SIGTERM) so it does not outlive a script that was
itself killed.  Use the servers as context managers, or call ``stop()`` in a ``finally``.

The client and comparison helpers mirror tests/vllm/serving.py (scripts do not import tests/).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

from afd_mrv2.procs import die_with_parent, stat_fields
from afd_mrv2.serve.client import Greedy as Greedy  # re-exported for the scripts
from afd_mrv2.serve.client import LineReader, complete
from afd_mrv2.serve.client import body as body
from afd_mrv2.serve.client import compare as compare
from afd_mrv2.serve.client import greedy as greedy
from afd_mrv2.serve.client import prompts as prompts
from afd_mrv2.serve.plan import free_port_block as free_port_block

T = TypeVar("T")

#: Engine arguments both sides get unless the command line says otherwise (fp32: exact comparisons).
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16", "--seed", "0"]
#: Every engine's environment defaults (the caller's environment wins): nothing downloaded, 1 GiB KV cache.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
READY = "afd-mrv2 serve: ready at"
SERVE_ERROR = "afd-mrv2 serve: error:"
FFN_DONE = "afd-mrv2 ffn: done "
START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
STOP_GRACE_S = 30
#: vLLM's histogram of tokens per engine step: its count is the engine's step count.
STEPS_METRIC = "vllm:iteration_tokens_total_count{"


class UsageError(Exception):
    """Bad input on the command line: one line on stderr, exit 2."""


class ServerError(Exception):
    """A server did not become ready (or failed): one line, the log names the rest."""


# --- input checks -----------------------------------------------------------------------------------------


def check_vllm() -> None:
    """Refuse a Python that cannot import vLLM (without importing it: that takes seconds)."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(f"vLLM is not importable by {sys.executable}; run with .venv-vllm/bin/python")


def check_model(path: str) -> Path:
    model = Path(path)
    if not (model / "config.json").is_file():
        raise UsageError(
            f"MODEL: {path} is not a checkpoint folder (no config.json); make one with afd-mrv2 make-model"
        )
    return model.resolve()


def parse_cpu_list(text: str) -> list[int]:
    """``0``, ``0,1``, ``0-3`` -> core ids; each must be one this process may run on."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise UsageError(f"expected a CPU list such as 0 or 0,1 or 0-3, got {text!r}") from None
    available = os.sched_getaffinity(0)
    if not cores or not set(cores) <= available:
        raise UsageError(f"CPU list {text!r}: expected cores among {sorted(available)}")
    return sorted(set(cores))


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


# --- processes --------------------------------------------------------------------------------------------


def sigterm_as_interrupt() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so the ``finally`` blocks stop every server
    (SIGINT explicitly: a background job of a non-interactive shell starts with SIGINT ignored)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, handler)


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant (from /proc)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None:
            parent[int(entry.name)] = int(fields[1])
    found, frontier = [root], {root}
    while frontier:
        kids = {pid for pid, ppid in parent.items() if ppid in frontier}
        found += sorted(kids)
        frontier = kids
    return found


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and its live descendants."""
    ticks = 0
    for pid in _tree(root):
        if (fields := stat_fields(pid)) is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def role_binds(pids: dict[str, int]) -> dict[str, str]:
    """Each role's ``VLLM_CPU_OMP_THREADS_BIND``, read from its environment in /proc."""
    binds = {}
    for name, pid in pids.items():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            binds[name] = "?"
            continue
        value = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(BIND_ENV.encode() + b"=")), "")
        binds[name] = value or "unpinned"
    return binds


def count_cores(bind: str) -> int:
    """Cores named by a ``VLLM_CPU_OMP_THREADS_BIND`` value (0 when it is not a plain CPU list)."""
    try:
        return len(parse_cpu_list(bind))
    except UsageError:
        return 0


class Child:
    """A server process in its own session, its output in a log file."""

    name = "server"
    proc: subprocess.Popen[str]

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, *, stdout_pipe: bool) -> None:
        self.log = log
        self.cmd = cmd
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self._seen: set[tuple[int, str]] = set()  # (pid, start time) of every process seen in the tree
        self._paused: list[int] = []  # the pids SIGSTOPped by pause(), root first
        self._termed = False  # begin_stop() sent the stop signal: stop() must not send it twice
        #: How long stop() waits for the server to end after its stop signal, before SIGKILL.
        self.stop_wait_s: float = STOP_GRACE_S
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else self._log_file,
            stderr=self._log_file,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # no server outlives the script
        )

    def log_text(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def track(self) -> list[int]:
        """The pids of the server's process tree now (remembered, so :meth:`stop` can check them)."""
        pids = _tree(self.proc.pid)
        for pid in pids:
            if (fields := stat_fields(pid)) is not None:
                self._seen.add((pid, fields[19]))
        return pids

    def leftovers(self, settle_s: float = 3.0) -> list[int]:
        """Processes seen in the server's tree that are still alive ``settle_s`` after the call
        (a process SIGKILLed a moment ago is still listed until the kernel has torn it down)."""
        deadline = time.monotonic() + settle_s
        while True:
            alive = []
            for pid, start in sorted(self._seen):
                fields = stat_fields(pid)
                if fields is not None and fields[19] == start and fields[0] not in ("Z", "X"):
                    alive.append(pid)
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.1)

    def pause(self, timeout_s: float = 5.0) -> list[int]:
        """SIGSTOP every live process of the server's tree (root first), and wait until each is in state ``T``
        (:class:`ServerError` if one is not within ``timeout_s``); returns their pids."""
        pids = [pid for pid in self.track() if (fields := stat_fields(pid)) is not None and fields[0] not in ("Z", "X")]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        self._paused = pids
        deadline = time.monotonic() + timeout_s
        while running := self.not_stopped():
            if time.monotonic() >= deadline:
                raise ServerError(f"{self.name}: pids {running} not stopped {timeout_s:.0f} s after SIGSTOP")
            time.sleep(0.02)
        return pids

    def not_stopped(self) -> list[int]:
        """The paused pids (and any process of the tree now) not in state ``T``; gone or zombie ones do not count."""
        running = []
        for pid in sorted(set(self._paused) | set(_tree(self.proc.pid))):
            fields = stat_fields(pid)
            if fields is not None and fields[0] not in ("T", "t", "Z", "X"):
                running.append(pid)
        return running

    def resume(self) -> None:
        """SIGCONT every paused process, leaves first (a parent resumed before its children sees them stopped)."""
        for pid in reversed(self._paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._paused = []

    def processes(self) -> dict[int, str]:
        """Each live process of the server's tree -> a label: its role (:meth:`_named`) and its kind."""
        named = self._named()
        parent = {pid: int(fields[1]) for pid in _tree(self.proc.pid) if (fields := stat_fields(pid)) is not None}
        labels: dict[int, str] = {}
        for pid in parent:
            if pid in named:
                labels[pid] = named[pid][0]
                continue
            up = parent[pid]
            while up in parent and up not in named:
                up = parent[up]
            labels[pid] = named.get(up, ("", ""))[1] + _kind(pid)
        seen: dict[str, int] = {}
        for label in labels.values():
            seen[label] = seen.get(label, 0) + 1
        return {pid: f"{label} (pid {pid})" if seen[label] > 1 else label for pid, label in labels.items()}

    def _named(self) -> dict[int, tuple[str, str]]:
        """Processes with a name of their own: pid -> (label, prefix of its descendants' labels)."""
        return {self.proc.pid: ("APIServer", "")}

    def _term(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)

    def begin_stop(self) -> None:
        """Resume the server if paused and send its stop signal without waiting (:meth:`stop` then waits):
        several servers stop at once."""
        self.resume()
        if self.proc.poll() is None and not self._termed:
            self.track()
            with contextlib.suppress(ProcessLookupError):
                self._term()
            self._termed = True

    def stop(self) -> int | None:
        """SIGTERM (unless :meth:`begin_stop` sent it), SIGKILL after :attr:`stop_wait_s`, then SIGKILL anything
        of its tree still alive; returns the exit code.  A paused server is resumed first."""
        self.resume()
        if self.proc.poll() is None:
            self.track()
            try:
                if not self._termed:
                    self._term()
                    self._termed = True
                self.proc.wait(self.stop_wait_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):  # an engine core whose parent died first
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.leftovers():  # anything else of its tree (a role in a session of its own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self._log_file.close()
        return self.proc.returncode

    def __enter__(self) -> Child:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _kind(pid: int) -> str:
    """What a process is, from its title or command line: vLLM's ``EngineCore`` / ``Worker`` / ``APIServer``
    (its process titles), multiprocessing's ``resource_tracker``, else its command name."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if comm.startswith("VLLM::"):
        return {"EngineCor": "EngineCore"}.get(comm[6:], comm[6:])
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    return comm


def process_cpu(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each live pid (all its threads; not its children)."""
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        pid: (int(fields[11]) + int(fields[12])) / ticks for pid in pids if (fields := stat_fields(pid)) is not None
    }


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**BASE_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(BIND_ENV, None)  # each side pins itself (plain: below; serve: per role)
    env.update(extra)
    return env


def wait_health(child: Child, url: str, timeout_s: float) -> float:
    deadline = child.started + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise ServerError(f"{child.name} exited {child.proc.returncode} before ready: {last_line(child)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - child.started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise ServerError(f"{child.name} not ready within {timeout_s:.0f} s (log {child.log})")


def last_line(child: Child) -> str:
    """serve's one-line error if it printed one, else the log's last non-empty line."""
    lines = [line for line in child.log_text().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(SERVE_ERROR)]
    return (errors or lines or [f"(empty log {child.log})"])[-1].strip()


class PlainServer(Child):
    """Plain vLLM's OpenAI server (afd-mrv2 installed, no ``afd`` section), pinned to ``cores``."""

    name = "plain vLLM"

    def __init__(
        self, model: Path, port: int, log: Path, engine_args: list[str], cores: str, env: dict[str, str] | None = None
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.cores = cores
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *engine_args]
        super().__init__(cmd, _env({**(env or {}), BIND_ENV: cores}), log, stdout_pipe=False)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        return wait_health(self, self.url, timeout_s)


@dataclass
class ServeTopology:
    """serve's topology flags, and a base ``afd`` section (``--afd``) when given."""

    attention: int = 1
    ffn: int = 1
    depth: str | None = None
    afd: dict[str, Any] | None = None
    #: serve --ubatches N (Model Runner V2 and afd-mrv2's worker on the Attention engines; 1: unsplit); None: no flag
    ubatches: int | None = None
    #: serve --stop-grace S (None: serve's default, 5 s)
    stop_grace: float | None = None

    @property
    def label(self) -> str:
        depth = f"-d{self.depth}" if self.depth else ""
        ubatches = f"-u{self.ubatches}" if self.ubatches is not None else ""
        return f"{self.attention}a{self.ffn}f{depth}{ubatches}"

    def ports(self) -> int:
        """How many consecutive ports serve needs: endpoint, one per engine, the AFD rendezvous."""
        return self.attention + 2


@dataclass
class FfnDone:
    """One FFN role's ``afd-mrv2 ffn: done {...}`` report."""

    rank: int
    report: dict[str, Any] = field(default_factory=dict)


class ServeServer(Child):
    """``afd-mrv2 serve`` (next to this Python) with the given topology and engine arguments."""

    name = "afd-mrv2 serve"

    def __init__(
        self,
        model: Path,
        port: int,
        log: Path,
        topology: ServeTopology,
        engine_args: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.topology = topology
        exe = Path(sys.executable).with_name("afd-mrv2")
        cmd = [str(exe), "serve", str(model), "--attention", str(topology.attention), "--ffn", str(topology.ffn)]
        cmd += ["--port", str(port)]
        if topology.depth:
            cmd += ["--depth", topology.depth]
        if topology.ubatches is not None:
            cmd += ["--ubatches", str(topology.ubatches)]
        if topology.stop_grace is not None:
            cmd += ["--stop-grace", f"{topology.stop_grace:g}"]
        if topology.afd:
            cmd += ["--afd", json.dumps(topology.afd)]
        cmd += ["--", *engine_args]
        self.ready_at: float | None = None
        super().__init__(cmd, _env(env or {}), log, stdout_pipe=True)
        if topology.stop_grace is not None:  # serve's own grace, and time for its FFN roles' reports
            self.stop_wait_s = max(STOP_GRACE_S, topology.stop_grace + 15)
        self._out = LineReader(self.proc.stdout)  # type: ignore[arg-type]

    def engine_urls(self) -> list[str]:
        """Each Attention engine's own vLLM server (``PORT+1+i``)."""
        return [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(self.topology.attention)]

    @property
    def stdout(self) -> list[str]:
        return self._out.lines

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds to the ready line; :class:`ServerError` with serve's one-line error if it exits first."""
        if not self._out.wait_for(READY, deadline=self.started + timeout_s, alive=lambda: self.proc.poll() is None):
            if self.proc.poll() is not None:
                self.proc.wait()
                raise ServerError(f"serve exited {self.proc.returncode}: {last_line(self)}")
            raise ServerError(f"serve not ready within {timeout_s:.0f} s (log {self.log})")
        self.ready_at = time.monotonic()
        return self.ready_at - self.started

    def role_pids(self) -> dict[str, int]:
        """``attention 0`` / ``ffn 0`` -> pid, from serve's ``[ffn 0] started pid N:`` lines."""
        pids = {}
        for line in self.log_text().splitlines():
            if line.startswith("[") and "] started pid " in line:
                name, rest = line[1:].split("] started pid ", 1)
                pids[name] = int(rest.split(":", 1)[0])
        return pids

    def _named(self) -> dict[int, tuple[str, str]]:
        named = {self.proc.pid: ("serve (supervisor + proxy)", "")}
        for role, pid in self.role_pids().items():
            named[pid] = (f"{role} {'APIServer' if role.startswith('attention') else 'role'}", f"{role} ")
        return named

    def _term(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # serve stops its roles itself (and reports how)

    def ffn_reports(self) -> list[FfnDone]:
        """Every ``[ffn N] afd-mrv2 ffn: done {JSON}`` line serve copied from its FFN roles, by rank."""
        found = []
        for line in self.log_text().splitlines():
            if line.startswith("[ffn ") and FFN_DONE in line:
                rank = int(line[len("[ffn ") :].split("]", 1)[0])
                try:
                    report = json.loads(line.split(FFN_DONE, 1)[1])
                except ValueError:
                    report = {"unparsed": line.split(FFN_DONE, 1)[1]}
                found.append(FfnDone(rank, report))
        return sorted(found, key=lambda d: d.rank)


# --- clients ----------------------------------------------------------------------------------------------


@dataclass
class Round:
    """R requests answered by C concurrent clients."""

    wall_s: float
    answers: list[tuple[int, dict[str, Any] | str]]

    @property
    def failures(self) -> list[str]:
        return [f"{status}: {str(a)[:200]}" for status, a in self.answers if status != 200 or not isinstance(a, dict)]

    @property
    def output_tokens(self) -> int:
        return sum(int(a["usage"]["completion_tokens"]) for s, a in self.answers if s == 200 and isinstance(a, dict))

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_requests(url: str, payloads: list[dict[str, Any]], clients: int) -> Round:
    """Send ``payloads`` from ``clients`` concurrent client threads; wall time from the first send to the last answer."""
    with ThreadPoolExecutor(max(1, min(clients, len(payloads)))) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda p: complete(url, p, REQUEST_TIMEOUT_S), payloads))
        wall = time.perf_counter() - start
    return Round(wall, answers)


def collective_rpc(url: str, method: str, timeout: float = 120) -> list[Any]:
    """``collective_rpc(method)`` on the vLLM OpenAI server at ``url`` (started with ``VLLM_SERVER_DEV_MODE=1``):
    one result per worker."""
    req = urllib.request.Request(
        url + "/collective_rpc", json.dumps({"method": method}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return list(json.loads(resp.read())["results"])
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise ServerError(f"{url}/collective_rpc {method}: {exc}") from None


def engine_steps(url: str, timeout: float = 60) -> int | None:
    """The engine steps vLLM's server at ``url`` counted (``vllm:iteration_tokens_total_count`` summed over its
    engines, ``GET /metrics``); None when the metric is missing."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(STEPS_METRIC)]
    return int(sum(counts)) if counts else None


def guarded(prog: str, body: Callable[[], T]) -> T | int:
    """Run a script's ``body`` with the scripts' error contract: bad input -> one line, 2; a
    server that failed -> one line, 1; Ctrl-C / SIGTERM -> 130 (every server already stopped)."""
    sigterm_as_interrupt()
    try:
        return body()
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every server stopped", file=sys.stderr)
        return 130


def write_json(path: str | None, doc: Any) -> None:
    """``doc`` as indented JSON at ``path`` (parents created), and a line saying where; nothing for None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"json: {path}")
