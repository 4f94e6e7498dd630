"""Run ``afd-mrv2 serve`` with fake roles (tests/serve/serve_harness.py) as a child process and watch it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from afd_mrv2.ports import free_port_block as free_port_block  # re-exported for the serve tests
from afd_mrv2.procs import alive

HARNESS = str(Path(__file__).with_name("serve_harness.py"))
READY = "afd-mrv2 serve: ready at"


def read_lines(
    proc: subprocess.Popen[str],
) -> tuple[list[tuple[float, str]], list[tuple[float, str]], list[threading.Thread]]:
    """Collect ``proc``'s stdout and stderr lines with their arrival times (``time.monotonic()``), each on a
    daemon thread: (stdout lines, stderr lines, the two threads)."""
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []

    def read(stream: object, into: list[tuple[float, str]]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append((time.monotonic(), line.rstrip("\n")))

    threads = [
        threading.Thread(target=read, args=pair, daemon=True) for pair in ((proc.stdout, out), (proc.stderr, err))
    ]
    for thread in threads:
        thread.start()
    return out, err, threads


class Serve:
    """One ``serve`` child: stdout and stderr lines with arrival times, the role pids it logged."""

    def __init__(self, args: list[str], behaviour: dict[str, object] | None = None) -> None:
        env = dict(os.environ, FAKE_ROLE=json.dumps(behaviour or {}), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, HARNESS, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.out, self.err, self._threads = read_lines(self.proc)

    def wait_ready(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, line in self.out:
                if line.startswith(READY):
                    return line.split()[-1]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"serve not ready (rc {self.proc.poll()}):\n" + "\n".join(self.err_lines()))

    def err_lines(self) -> list[str]:
        return [line for _, line in self.err]

    def out_lines(self) -> list[str]:
        return [line for _, line in self.out]

    def pids(self) -> dict[str, int]:
        """``{"ffn 0": pid, "attention 1": pid, "grandchild of ffn 0": pid}`` from the fakes' log lines."""
        found: dict[str, int] = {}
        for line in self.err_lines():
            if "] pid " in line:
                role, rank, pid = line.split("] pid ", 1)[1].split()
                found[f"{role} {rank}"] = int(pid)
            elif "] grandchild " in line:
                name = line[1 : line.index("]")]
                found[f"grandchild of {name}"] = int(line.rsplit(" ", 1)[1])
        return found

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 15.0) -> int:
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@pytest.fixture
def start_serve() -> Iterator[object]:
    started: list[Serve] = []

    def start(attention: int, ffn: int, behaviour: dict[str, object] | None = None, *extra: str) -> tuple[Serve, int]:
        """``attention`` fake engines (``--attention-groups`` = ``--attention``: independent engines, each a role
        process, unless ``extra`` says), ``ffn`` fake FFN ranks."""
        port = free_port_block(attention + 2)
        groups = [] if "--attention-groups" in extra else ["--attention-groups", str(attention)]
        serve = Serve(
            ["/models/fake", "--attention", str(attention), *groups, "--ffn", str(ffn), "--port", str(port), *extra],
            behaviour,
        )
        started.append(serve)
        return serve, port

    yield start
    for serve in started:
        pids = serve.pids()
        serve.kill()
        for pid in pids.values():  # never leave a fake behind, whatever the test did
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
