"""The servers the scripts and tests/vllm compare: plain vLLM and ``afd-mrv2 serve``, as child processes.

* :class:`PlainServer`: plain vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
  as a child process group, pinned with ``VLLM_CPU_OMP_THREADS_BIND``;
* :class:`ServeServer`: ``afd-mrv2 serve MODEL --attention A --ffn F ...`` (stdout read for the ready
  line, stderr to a log file; the FFN roles' ``afd-mrv2 ffn: done {...}`` reports read back from it);
* :meth:`Child.pause` / :meth:`Child.resume`: SIGSTOP / SIGCONT of every process of a server's tree
  (checked: each in state ``T``), :meth:`Child.processes`: each process by role and kind
  (``APIServer``, ``EngineCore``, ``Worker``, ...).

Every child runs in a session of its own (Ctrl-C reaches only the caller, which stops them) with
``PR_SET_PDEATHSIG`` (SIGTERM): it never outlives its caller.  Use them as context managers.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from afd_mrv2.procs import start_pinned, stat_fields

from .client import Greedy, LineReader, body, greedy, prompts, run_requests
from .host import BIND_ENV, ServerError, kind, parse_cpu_list, tree

#: Engine arguments both sides get unless the caller says otherwise (fp32: exact comparisons).
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16", "--seed", "0"]
#: Every engine's environment defaults (the caller's environment wins): nothing downloaded, 1 GiB KV cache.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
READY = "afd-mrv2 serve: ready at"
SERVE_ERROR = "afd-mrv2 serve: error:"
FFN_DONE = "afd-mrv2 ffn: done "
START_TIMEOUT_S = 900
STOP_GRACE_S = 30


class Child:
    """A server process in its own session, its output in a log file."""

    name = "server"
    proc: subprocess.Popen[str]

    def __init__(
        self, cmd: list[str], env: dict[str, str], log: Path, *, stdout_pipe: bool, cores: tuple[int, ...] = ()
    ) -> None:
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
            # every process of the server on ``cores`` (none: unpinned); no server outlives the script
            preexec_fn=functools.partial(start_pinned, cores, signal.SIGTERM),
        )

    def wait_exit(self, timeout_s: float) -> int:
        """The exit code, once the server exited by itself within ``timeout_s`` (``TimeoutExpired`` if not)."""
        return self.proc.wait(timeout_s)

    def log_text(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def track(self) -> list[int]:
        """The pids of the server's process tree now (remembered, so :meth:`stop` can check them)."""
        pids = tree(self.proc.pid)
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
        for pid in sorted(set(self._paused) | set(tree(self.proc.pid))):
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
        parent = {pid: int(fields[1]) for pid in tree(self.proc.pid) if (fields := stat_fields(pid)) is not None}
        labels: dict[int, str] = {}
        for pid in parent:
            if pid in named:
                labels[pid] = named[pid][0]
                continue
            up = parent[pid]
            while up in parent and up not in named:
                up = parent[up]
            labels[pid] = named.get(up, ("", ""))[1] + kind(pid)
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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


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
    """Plain vLLM's OpenAI server (afd-mrv2 installed, no ``afd`` section): every process of it (front end,
    EngineCore, worker) pinned to ``cores``, its OpenMP threads bound to them."""

    name = "plain vLLM"

    def __init__(
        self, model: Path, port: int, log: Path, engine_args: list[str], cores: str, env: dict[str, str] | None = None
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.cores = cores
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *engine_args]
        pinned = tuple(parse_cpu_list(cores))  # every process, as serve pins each role's: equal treatment
        super().__init__(cmd, _env({**(env or {}), BIND_ENV: cores}), log, stdout_pipe=False, cores=pinned)

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
    #: serve --stop-grace-s S (None: serve's default, 5 s)
    stop_grace: float | None = None
    #: any further serve flags, as given (``("--connector", "my_link")``)
    flags: tuple[str, ...] = ()
    #: serve --attention-groups G: None gives each Attention rank its own engine (G = A, the harness's default
    #: since before groups); 1: one vLLM data-parallel deployment of all of them
    groups: int | None = None
    #: serve --attention-tp T
    tp: int = 1

    @property
    def engines(self) -> int:
        """The Attention role processes (vLLM servers): one per group."""
        return self.attention if self.groups is None else self.groups

    @property
    def label(self) -> str:
        depth = f"-d{self.depth}" if self.depth else ""
        ubatches = f"-u{self.ubatches}" if self.ubatches is not None else ""
        layout = "" if self.groups is None else f"-dp{self.attention // self.groups}"
        layout += f"-tp{self.tp}" if self.tp > 1 else ""
        return f"{self.attention}a{self.ffn}f{layout}{depth}{ubatches}"

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
        cmd += ["--attention-groups", str(topology.engines), "--port", str(port)]
        if topology.tp > 1:
            cmd += ["--attention-tp", str(topology.tp)]
        if topology.depth:
            cmd += ["--depth", topology.depth]
        if topology.ubatches is not None:
            cmd += ["--ubatches", str(topology.ubatches)]
        if topology.stop_grace is not None:
            cmd += ["--stop-grace-s", f"{topology.stop_grace:g}"]
        if topology.afd:
            cmd += ["--afd", json.dumps(topology.afd)]
        cmd += topology.flags
        cmd += ["--", *engine_args]
        self.ready_at: float | None = None
        super().__init__(cmd, _env(env or {}), log, stdout_pipe=True)
        if topology.stop_grace is not None:  # serve's own grace, and time for its FFN roles' reports
            self.stop_wait_s = max(STOP_GRACE_S, topology.stop_grace + 15)
        assert self.proc.stdout is not None  # stdout_pipe=True
        self._out = LineReader(self.proc.stdout)

    def engine_urls(self) -> list[str]:
        """Each Attention group's own vLLM server (``PORT+1+i``; a group of one: an engine)."""
        return [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(self.topology.engines)]

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

    def role_pid(self, name: str) -> int:
        """The pid serve started for role ``name`` (``ffn 0``); :class:`ServerError` when it has not logged one."""
        pid = self.role_pids().get(name)
        if pid is None:
            raise ServerError(f"serve logged no start line for {name}")
        return pid

    def _named(self) -> dict[int, tuple[str, str]]:
        named = {self.proc.pid: ("serve (supervisor + proxy)", "")}
        for role, pid in self.role_pids().items():
            named[pid] = (f"{role} {'APIServer' if role.startswith('attention') else 'role'}", f"{role} ")
        return named

    def _term(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # serve stops its roles itself (and reports how)

    def ffn_reports(self) -> list[FfnDone]:
        """Every FFN role's ``done`` report serve copied to its log, by rank (:func:`ffn_reports`)."""
        return ffn_reports(self.log_text())


def ffn_reports(log_text: str) -> list[FfnDone]:
    """Every ``[ffn N] afd-mrv2 ffn: done {JSON}`` line of a serve log, by rank."""
    found = []
    for line in log_text.splitlines():
        if line.startswith("[ffn ") and FFN_DONE in line:
            rank = int(line[len("[ffn ") :].split("]", 1)[0])
            try:
                report = json.loads(line.split(FFN_DONE, 1)[1])
            except ValueError:
                report = {"unparsed": line.split(FFN_DONE, 1)[1]}
            found.append(FfnDone(rank, report))
    return sorted(found, key=lambda d: d.rank)


def greedy_round(server: PlainServer | ServeServer, model: Path, completions: int, tokens: int) -> list[Greedy]:
    """``completions`` greedy requests of ``tokens`` tokens, all at once; :class:`ServerError` if any is
    not answered."""
    payloads = [body(model, p, tokens, logprobs=1, return_token_ids=True) for p in prompts(completions)]
    result = run_requests(server.url, payloads, completions)
    server.track()
    if result.failures:
        raise ServerError(f"{len(result.failures)}/{completions} requests failed: {result.failures[0]}")
    return [greedy(a) for _, a in result.answers if isinstance(a, dict)]  # every one is: no failure above
