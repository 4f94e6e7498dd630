"""Helpers for tests that start processes: loopback only, bounded, and always cleaned up.

Every process a test starts runs in a session of its own; ``cleanup`` kills that
session and every worker pid the launcher recorded in ``workers.json``, so a
failing assertion never leaves a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from afd_mrv2.procs import alive

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "AFD_MRV2_RUN_CONFIG")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


class Proc:
    """A started process whose stdout and stderr are collected line by line in the background."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        self.popen = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or child_env(),
            cwd=cwd,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.err_times: list[float] = []  # time.monotonic() when each stderr line arrived
        self._readers = [
            threading.Thread(target=self._pump, args=(self.popen.stdout, self.out, []), daemon=True),
            threading.Thread(target=self._pump, args=(self.popen.stderr, self.err, self.err_times), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _pump(stream: object, lines: list[str], times: list[float]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            times.append(time.monotonic())
            lines.append(line.rstrip("\n"))

    def wait_for_stderr(self, needle: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(needle in line for line in self.err):
                return True
            if self.popen.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def wait(self, timeout_s: float) -> int:
        code = self.popen.wait(timeout_s)
        for reader in self._readers:
            reader.join(2.0)
        return code

    @property
    def stdout(self) -> str:
        return "\n".join(self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)


def afd(*args: str, env: dict[str, str] | None = None) -> Proc:
    """``afd-mrv2 ARGS`` as a child process."""
    return Proc([sys.executable, "-m", "afd_mrv2.cli", *args], env=env)


def workers(out_dir: Path, timeout_s: float = 60.0) -> list[dict]:
    """The launcher's workers.json, once it exists."""
    path = out_dir / "workers.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout_s} s")


def cleanup(*procs: Proc, out_dir: Path | None = None) -> None:
    """Kill every process a test started (sessions and recorded workers)."""
    pids = []
    if out_dir is not None:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            pids = [w["pid"] for w in json.loads((out_dir / "workers.json").read_text())]
    for proc in procs:
        if proc.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(5)
    for pid in pids:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def running(*procs: Proc, out_dir: Path | None = None) -> Iterator[None]:
    try:
        yield
    finally:
        cleanup(*procs, out_dir=out_dir)


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as gone)."""
    return not alive(pid)
