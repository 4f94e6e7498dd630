"""Process utilities, one copy each: parent-death signal, ``/proc`` state, free ports, the CPU's flags.

Used by the embedded run's launcher and workers, serve's supervisor and roles, the FFN
leader watch, the benchmark scripts and the tests.  A leaf: imports nothing of afd_mrv2.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def start_pinned(cores: tuple[int, ...], sig: int = signal.SIGKILL) -> None:
    """Between fork and exec (``preexec_fn``): pin this process to ``cores`` (every process it starts inherits
    them; none: unchanged), then :func:`die_with_parent` with ``sig``."""
    if cores and sys.platform.startswith("linux"):  # sched_setaffinity is Linux's
        os.sched_setaffinity(0, cores)
    die_with_parent(sig)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: this process gets ``sig`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing.

    Safe between fork and exec (``preexec_fn``): no allocation beyond ctypes' call.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None when it is gone
    (or there is no ``/proc``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs: a zombie (exited, not yet reaped) counts as gone.

    Without ``/proc`` the signal-0 probe answers (a zombie then counts as alive).
    """
    fields = stat_fields(pid)
    if fields is not None:
        return fields[0] not in ("Z", "X")
    if Path("/proc").is_dir():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> dict[int, str] | None:
    """The live processes of process group ``pgid`` (zombies excluded), pid -> command name; None without
    ``/proc``."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    members = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members[int(entry.name)] = name
    return members


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` is alive (zombies, which only wait to be reaped, do not count)."""
    members = group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick; another process may take it before you bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``VmHWM``; ``ru_maxrss`` where there is no ``/proc``)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def cpu_flags(cpuinfo: Path | str = "/proc/cpuinfo") -> frozenset[str] | None:
    """This host's CPU feature flags (the ``flags`` line of ``/proc/cpuinfo``: ``amx_tile``, ``avx512_bf16``,
    ...), or None where there is no such file or line (not Linux, or not x86)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None
