"""Faults in ``afd-mrv2 run``: every one ends in bounded time, with errors that name the culprit.

Both fault cases run on every pair transport (``--transport`` gloo, zmq and tcp):

* an FFN process killed mid-run: every other process exits non-zero within 10 s
  on its own (not killed by the launcher), each naming the dead peer;
* a peer that stops sending (SIGSTOP): the waiting side fails with a clear
  error at the configured deadline (--recv-timeout-s 2);
* SIGINT to the launcher: it stops every worker with SIGTERM (its first step, before any SIGKILL) and
  exits 130.

Deadlines are the product's (``--recv-timeout-s``, the launcher's 2 s SIGTERM grace); the tests bound
what they wait for generously and check the cause (which deadline fired, which signal ended a worker),
so a loaded machine makes them slower, never red.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.mrv2.conftest import PROCESS_TRANSPORTS
from tests.procs import Proc, afd, gone, running, workers

# Long enough to be mid-run when the fault comes, small enough to start fast.
LONG = ["--hidden", "64", "--expert-size", "128", "--batches", "400", "--warmup", "0"]


def wait_all_gone(pids: list[int], timeout_s: float, *, context: Callable[[], str] = str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if all(gone(pid) for pid in pids):
            return time.monotonic() - start
        time.sleep(0.02)
    alive = [p for p in pids if not gone(p)]
    raise AssertionError(f"processes {alive} still alive after {timeout_s} s: {_states(alive)}{context()}")


def _launcher_state(proc: Proc) -> str:
    """Whether the launcher still runs (then its threads' kernel waits and, from its SIGUSR1 faulthandler, its
    Python stacks), and the last lines it (and its workers) wrote."""
    running = proc.popen.poll() is None
    threads = ""
    if running:
        tasks = sorted(Path(f"/proc/{proc.popen.pid}/task").glob("*"))
        threads = f"; its threads: {_states([int(t.name) for t in tasks])}"
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, signal.SIGUSR1)
            time.sleep(1.0)
    tail = "\n".join(proc.stderr.splitlines()[-40:])
    return f"\nlauncher exit status {proc.popen.poll()}{threads}; stderr (tail):\n{tail}"


def _states(pids: list[int]) -> str:
    """Each live process's scheduler state and kernel wait channel (why it did not end), from /proc."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError as exc:
            stat, wchan = "?", str(exc)
        out.append(f"{pid} state {stat} wchan {wchan}")
    return "; ".join(out)


def failure_line(err: list[str], name: str) -> tuple[int, str]:
    prefix = f"afd-mrv2 run: {name[:-1]}"  # "attention rank 0 (global rank 0" + ", pid ... on host)"
    for i, line in enumerate(err):
        if line.startswith(prefix) and " failed: " in line:
            return i, line
    raise AssertionError(f"no failure line for {name}:\n" + "\n".join(err[-30:]))


@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
def test_killed_ffn_process_every_other_process_exits_naming_it(tmp_path: Path, transport: str) -> None:
    proc = afd("run", "--out", str(tmp_path), *LONG, "--attention", "2", "--ffn", "2", "--transport", transport)
    with running(proc, out_dir=tmp_path):
        assert proc.wait_for_stderr("[1/2] serialized", 90), proc.stderr
        time.sleep(1.0)
        victim = workers(tmp_path)[2]
        assert victim["name"] == "FFN rank 0 (global rank 2)"
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        assert proc.wait(40) == 1
    final = json.loads((tmp_path / "workers.json").read_text())
    assert final[2]["exit"] == "killed by SIGKILL"
    for w in final:
        if w["rank"] == 2:
            continue
        assert w["returncode"] == 1, w
        assert not w["killed_by_launcher"], w
        assert w["exited_at_monotonic"] - killed_at < 10, w
        _, line = failure_line(proc.err, w["name"])
        assert "FFN rank 0 (global rank 2" in line, line
        print(f"\n{w['name']}: exit {w['returncode']} {w['exited_at_monotonic'] - killed_at:.2f} s after the kill")
    assert "first: FFN rank 0 (global rank 2) (killed by SIGKILL)" in proc.stderr


@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
def test_stalled_peer_fails_the_waiting_side_at_the_deadline(tmp_path: Path, transport: str) -> None:
    proc = afd(
        "run", "--out", str(tmp_path), *LONG, "--recv-timeout-s", "2", "--grace-s", "5", "--transport", transport
    )
    with running(proc, out_dir=tmp_path):
        assert proc.wait_for_stderr("[1/2] serialized", 90), proc.stderr
        time.sleep(1.0)
        ws = workers(tmp_path)
        ffn = ws[2]["pid"]
        os.kill(ffn, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_all_gone([ws[0]["pid"], ws[1]["pid"]], 15)
        finally:
            os.kill(ffn, signal.SIGCONT)  # let the stalled rank see its peers gone and exit
        assert proc.wait(30) == 1
    final = json.loads((tmp_path / "workers.json").read_text())
    for w in final[:2]:
        assert w["returncode"] == 1 and not w["killed_by_launcher"], w
        index, line = failure_line(proc.err, w["name"])
        assert "FFN rank 0 (global rank 2" in line and "within 2 s (" in line, line  # the 2 s deadline fired
        after = proc.err_times[index] - stopped_at
        # not before the deadline; well before gloo's own 60 s timeout (late only by the machine's load)
        assert 1.5 <= after <= 30.0, f"failed {after:.2f} s after the stall, deadline 2 s: {line}"
        print(
            f"\n{w['name']}: failed {after:.2f} s after the stall (deadline 2 s), exited "
            f"{w['exited_at_monotonic'] - stopped_at:.2f} s after it"
        )


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_to_the_launcher_stops_every_worker(tmp_path: Path, inherited: str) -> None:
    """``ignored``: started as a shell without job control starts a background job, SIGINT ignored (POSIX);
    the launcher handles it all the same (this once made the test fail whenever pytest itself ran in the
    background)."""
    run = [sys.executable, "-m", "afd_mrv2.cli", "run", "--out", str(tmp_path), *LONG]
    proc = Proc(["bash", "-c", 'trap "" INT; exec "$@"', "bash", *run]) if inherited == "ignored" else Proc(run)
    with running(proc, out_dir=tmp_path):
        assert proc.wait_for_stderr("[1/2] serialized", 90), proc.stderr
        time.sleep(0.5)
        pids = [w["pid"] for w in workers(tmp_path)]
        assert not any(gone(pid) for pid in pids)
        proc.popen.send_signal(signal.SIGINT)
        elapsed = wait_all_gone(pids, 30.0, context=lambda: _launcher_state(proc))
        print(f"\nall {len(pids)} workers gone {elapsed:.2f} s after SIGINT")
        assert proc.wait(30) == 130
    assert "interrupted: stopping the workers" in proc.stderr
    final = json.loads((tmp_path / "workers.json").read_text())
    assert [w["pid"] for w in final] == pids
    for w in final:  # the launcher's SIGTERM ended each (or a peer's end, a moment before): never its SIGKILL
        assert w["killed_by_launcher"] and w["returncode"] in (-signal.SIGTERM, 1), w
