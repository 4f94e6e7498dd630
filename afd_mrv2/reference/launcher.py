"""The local launcher of ``afd-mrv2 run``: A + F worker processes on this machine.

See docs/internals/reference.md, "afd_mrv2.reference.launcher".
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from afd_mrv2 import envs
from afd_mrv2.procs import free_port
from afd_mrv2.reference.progress import progress
from afd_mrv2.reference.runconfig import CONFIG_ENV, RunConfig

_POLL_S = 0.05
_TERM_GRACE_S = 2.0


@dataclass
class _Worker:
    rank: int
    name: str
    proc: subprocess.Popen[bytes]
    returncode: int | None = None
    exited_at: float | None = None
    killed_by_launcher: bool = False

    def describe_exit(self) -> str:
        if self.returncode is None:
            return "still running"
        if self.returncode < 0:
            how = f"killed by {signal.Signals(-self.returncode).name}"
        else:
            how = f"exit status {self.returncode}"
        return how + (" (stopped by the launcher)" if self.killed_by_launcher else "")


def launch(cfg: RunConfig, *, as_json: bool, grace_s: float = 10.0) -> int:
    """Run ``cfg`` with one local process per rank; return the exit status."""
    out = Path(cfg.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "workers.json"):
        (out / stale).unlink(missing_ok=True)
    cfg = cfg.with_(out_dir=str(out))
    topology = cfg.topology
    port = free_port()
    pairs = "" if cfg.transport == "gloo" else f", Attention-FFN pairs on {cfg.transport}"
    progress(
        f"starting {cfg.attention_processes} attention + {cfg.num_ffn} FFN workers (gloo on 127.0.0.1:{port}{pairs}) ..."
    )
    workers: list[_Worker] = []
    started = time.monotonic()
    with _signals_handled():
        try:
            for rank in range(topology.world_size):
                workers.append(_start_worker(cfg, rank, port))
            _write_status(out, workers)
            _supervise(workers, grace_s)
        except KeyboardInterrupt:
            progress("interrupted: stopping the workers")
            _terminate(workers)
            _write_status(out, workers)
            return 130
        finally:
            _terminate(workers)
    _write_status(out, workers)
    failed = [w for w in workers if w.returncode != 0]
    if failed:
        # Exits seen in the same poll are ordered cause first: a signal death before an exit status.
        first = min(failed, key=lambda w: (w.exited_at or 0.0, (w.returncode or 0) >= 0))
        lines = [f"failed after {time.monotonic() - started:.1f} s; first: {first.name} ({first.describe_exit()})"]
        for w in sorted(workers, key=lambda w: w.rank):
            delay = (w.exited_at or 0.0) - (first.exited_at or 0.0)
            lines.append(f"  {w.name}, pid {w.proc.pid}: {w.describe_exit()}, {delay:+.2f} s")
        progress("\n".join(lines))
        return 1
    result = out / "result.json"
    if not result.is_file():
        progress(f"every worker exited 0 but rank 0 wrote no {result}")
        return 1
    report = json.loads(result.read_text())
    from afd_mrv2.reference.report import render  # imports torch: only once there is a report to render

    print(render(report, as_json=as_json), flush=True)
    return 0 if report["ok"] else 1


@contextlib.contextmanager
def _signals_handled() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt, and SIGUSR1 prints every thread's stack, while the block runs.

    SIGINT explicitly: a launcher started in the background by a shell without job control inherits SIGINT
    ignored, and would then let ``kill -INT`` pass (serve's supervisor handles both the same way).  The
    stacks go to fd 2: ``sys.stderr`` may be a capture without a descriptor (in-process callers).
    """
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        faulthandler.unregister(signal.SIGUSR1)


def _start_worker(cfg: RunConfig, rank: int, port: int) -> _Worker:
    """Rank ``rank`` of ``cfg`` as a process in a session of its own, told its rank and rendezvous by env."""
    world = str(cfg.topology.world_size)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=world,
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=world,
        OMP_NUM_THREADS="1",
        **{envs.LAUNCHER.name: str(os.getpid()), CONFIG_ENV: cfg.to_json()},
    )
    proc = subprocess.Popen([sys.executable, "-m", "afd_mrv2.cli", "run"], env=env, start_new_session=True)
    return _Worker(rank, cfg.topology.describe(rank), proc)


def _supervise(workers: list[_Worker], grace_s: float) -> None:
    """Wait for every worker; once one failed, give the rest ``grace_s`` and kill them."""
    first_failure: float | None = None
    while True:
        now = time.monotonic()
        running = 0
        for w in workers:
            if w.returncode is not None:
                continue
            code = w.proc.poll()
            if code is None:
                running += 1
                continue
            w.returncode, w.exited_at = code, now
            if code != 0 and first_failure is None:
                first_failure = now
        if not running:
            return
        if first_failure is not None and now - first_failure > grace_s:
            return  # _terminate (in launch's finally) stops the stragglers
        time.sleep(_POLL_S)


def _terminate(workers: list[_Worker]) -> None:
    """SIGTERM every live worker's process group, SIGKILL what is left after a grace period."""
    live = [w for w in workers if w.returncode is None and w.proc.poll() is None]
    for sig, wait_s in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        for w in live:
            w.killed_by_launcher = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, sig)
        deadline = time.monotonic() + wait_s
        for w in live:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
        live = [w for w in live if w.proc.poll() is None]
        if not live:
            break
    for w in workers:
        if w.returncode is None and w.proc.poll() is not None:
            w.returncode, w.exited_at = w.proc.returncode, time.monotonic()


def _write_status(out: Path, workers: list[_Worker]) -> None:
    status = [
        {
            "rank": w.rank,
            "name": w.name,
            "pid": w.proc.pid,
            "returncode": w.returncode,
            "exit": w.describe_exit(),
            "exited_at_monotonic": w.exited_at,
            "killed_by_launcher": w.killed_by_launcher,
        }
        for w in workers
    ]
    tmp = out / "workers.json.tmp"
    tmp.write_text(json.dumps(status, indent=2))
    tmp.replace(out / "workers.json")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    raise KeyboardInterrupt
