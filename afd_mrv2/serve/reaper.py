"""The reaper: nothing of a deployment outlives its supervisor, even a SIGKILLed one.

A role's leader dies with serve (``PR_SET_PDEATHSIG``), the processes vLLM starts under it (EngineCore,
workers) do not.  So serve starts this small process in a session of its own and tells it each role's
process group over a pipe only serve holds.  When the pipe ends without serve's ``bye``, the reaper sends
SIGTERM to every group still alive, SIGKILL after ``grace_s``, says so on stderr, and exits.  It forgets a
group once it is gone (looked at every second), so a reused process id is never signalled.

    python -c "$_ENTRY" GRACE_S SUPERVISOR_PID   (stdin: lines "+PGID" and "bye")
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import IO

from afd_mrv2.procs import group_alive

PREFIX = "afd-mrv2 serve reaper"
_LOOK_S = 1.0  # how often dead groups are forgotten
_BYE = b"bye"
#: the reaper process's code: ``-m afd_mrv2.serve.reaper`` would import the package (and this module) first
_ENTRY = "import sys; from afd_mrv2.serve.reaper import main; sys.exit(main())"


class Reaper:
    """The supervisor's side: start the reaper process, tell it each role's group, say bye on a clean stop."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _ENTRY, f"{self.grace_s:g}", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to serve's group does not reach it
        )

    def watch(self, pgid: int) -> None:
        """Stop process group ``pgid`` should serve die."""
        self._write(f"+{pgid}\n".encode())

    def close(self) -> None:
        """Serve stopped its roles itself: the reaper exits without touching anything."""
        if self._proc is None:
            return
        self._write(_BYE + b"\n")
        stdin: IO[bytes] | None = self._proc.stdin
        if stdin is not None:
            stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _write(self, line: bytes) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except BrokenPipeError:  # the reaper died: nothing more to tell it
            self._proc.stdin = None


def _read_until_gone(fd: int) -> tuple[set[int], bool]:
    """The groups serve named over ``fd`` and still alive when it ended, and whether it said bye."""
    groups: set[int] = set()
    pending = b""
    while True:
        if select.select([fd], [], [], _LOOK_S)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                return groups, False
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line == _BYE:
                    return groups, True
                if line.startswith(b"+") and line[1:].isdigit():
                    groups.add(int(line[1:]))
        groups = {g for g in groups if group_alive(g)}


def reap(groups: set[int], grace_s: float) -> tuple[list[int], list[int]]:
    """SIGTERM every group in ``groups``, SIGKILL those alive after ``grace_s``: (signalled, killed)."""
    signalled = sorted(g for g in groups if _signal(g, signal.SIGTERM))
    deadline = time.monotonic() + grace_s
    alive = list(signalled)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [g for g in alive if group_alive(g)]
    killed = [g for g in alive if _signal(g, signal.SIGKILL)]
    return signalled, killed


def _signal(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    grace_s, supervisor = float(args[0]), int(args[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for serve: serve says bye or dies
    groups, bye = _read_until_gone(sys.stdin.fileno())
    if bye or not groups:
        return 0
    signalled, killed = reap(groups, grace_s)
    if signalled:
        after = f", SIGKILL to {len(killed)} still alive after {grace_s:g} s" if killed else ""
        print(
            f"{PREFIX}: serve (pid {supervisor}) is gone; stopped the process groups of its roles "
            f"{', '.join(map(str, signalled))} (SIGTERM{after})",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
