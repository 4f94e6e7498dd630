"""One role process: started in a process group of its own, its output prefixed, its readiness and exit watched.

Each role runs in a new session (``start_new_session``), so its process id is
also its process-group id and the whole tree it spawns (vLLM's engine-core
process, for one) is signalled with one ``killpg``.  Its stdout and stderr are
merged and copied line by line to serve's stderr as ``[attention 0] ...``.

Readiness:

* FFN rank: it prints a line containing :data:`~afd_mrv2.serve.plan.FFN_READY_MARKER`
  or creates its ready file, whichever comes first;
* Attention rank: ``GET /health`` on its port answers 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import aiohttp

from afd_mrv2.items import ATTENTION
from afd_mrv2.procs import group_alive, group_members, start_pinned
from afd_mrv2.serve.plan import FFN_READY_MARKER, RoleSpec

POLL_S = 0.1
#: Known noise roles print while they exit: counted, shown as one line at the end instead of each
#: (nanobind, used by vLLM's dependencies, lists every object still alive at interpreter exit).
EXIT_NOISE = ("nanobind: leaked", "nanobind: this is likely caused by a reference counting issue")
#: vLLM's own abort shutdown (``--shutdown-timeout 0``, its default) kills the EngineCore before it
#: cancels the API server's output handler, which then may log ``AsyncLLM output_handler failed.`` and
#: an ``EngineDeadError`` traceback.  Once serve has told a role to stop, such a block (each of its lines
#: tagged with the same logger location) is folded into one line; any other block is shown as it is.
ABORT_BLOCK_START = "AsyncLLM output_handler failed."
ABORT_BLOCK_END = "EngineDeadError"
#: A group member that ended this long before its leader is no cause of the leader's exit (a compiler
#: run vLLM started, say); one that ended within it is named as the cause (vLLM's EngineCore, say).
CAUSE_WINDOW_S = 10.0
#: Build tools vLLM and torch run in an engine's group for a moment (a kernel compiled on first use): they
#: end by themselves, so their end is never named as the cause of the leader's exit.
TOOLCHAIN = frozenset({"g++", "gcc", "c++", "cc", "cc1", "cc1plus", "as", "ld", "collect2", "sh", "ninja", "make"})
MEMBER_POLLS = 5  # the group's processes are listed every MEMBER_POLLS * POLL_S
LINE_LIMIT = 1 << 20


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def cause_of_exit(
    gone: Sequence[tuple[float, int, str]], exited: float, window_s: float = CAUSE_WINDOW_S
) -> tuple[int, str] | None:
    """The first of the group members ``gone`` (when seen gone, pid, name) that ended at most ``window_s``
    before the leader ``exited``: the likely cause of its exit; None when none did.  Build tools
    (:data:`TOOLCHAIN`) are never the cause: they end by themselves."""
    recent = [(pid, name) for seen, pid, name in gone if seen >= exited - window_s and name not in TOOLCHAIN]
    return recent[0] if recent else None


class RoleProcess:
    """One started role; ``ready`` is set once it is ready, ``on_exit`` is called once when its leader exits."""

    def __init__(self, spec: RoleSpec, log: TextIO, on_exit: Callable[[RoleProcess], None]) -> None:
        self.spec = spec
        self.log = log
        self.on_exit = on_exit
        self.ready = asyncio.Event()
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.returncode: int | None = None
        #: the first process of the role's group (not its leader) seen to end while the leader ran, at most
        #: CAUSE_WINDOW_S before the leader exited: (pid, name); set when the leader's exit is seen
        self.first_lost: tuple[int, str] | None = None
        self._gone: list[tuple[float, int, str]] = []  # (when seen gone, pid, name) of such processes
        self._members: dict[int, str] = {}
        self._noise = 0
        #: serve sent the stop signal: vLLM's abort-shutdown traceback is expected from now on
        self.stopping = False
        self._fold: list[str] = []  # the lines of a block that may be vLLM's abort-shutdown traceback
        self._fold_tag = ""
        self._folded = 0
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def describe(self) -> str:
        return f"{self.spec.title} (pid {self.pid})"

    def where(self) -> str:
        """Where it runs, for a message: ``pid N``."""
        return f"pid {self.pid}"

    async def start(self) -> None:
        self.started_at = time.time()  # wall clock, as the roles' live figures stamp their events
        env = {**self.spec.env, **os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = await asyncio.create_subprocess_exec(
            *self.spec.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            # every process of the role on its cores; SIGKILL should serve itself die without stopping it
            preexec_fn=functools.partial(start_pinned, self.spec.cores),
            env=env,
            limit=LINE_LIMIT,
        )
        self._say(f"started pid {self.proc.pid}: {' '.join(self.spec.argv[:6])} ...")
        self._tasks = [asyncio.ensure_future(self._pump()), asyncio.ensure_future(self._wait())]
        if self.spec.role == ATTENTION:
            self._tasks.append(asyncio.ensure_future(self._poll_health()))
        elif self.spec.ready_file is not None:
            self._tasks.append(asyncio.ensure_future(self._poll_ready_file(Path(self.spec.ready_file))))

    def _say(self, text: str) -> None:
        print(f"[{self.spec.name}] {text}", file=self.log, flush=True)

    async def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stream = self.proc.stdout
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over LINE_LIMIT: take what is buffered
                raw = await stream.read(LINE_LIMIT)
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line.lstrip().startswith(EXIT_NOISE):
                self._noise += 1
                continue
            if self._folding(line):
                continue
            self._say(line)
            if self.spec.role != ATTENTION and FFN_READY_MARKER in line:
                self.ready.set()

    def _folding(self, line: str) -> bool:
        """Whether ``line`` belongs to a block held back as vLLM's abort-shutdown traceback (see
        :data:`ABORT_BLOCK_START`); a held block that turns out to be something else is shown."""
        if self._fold:
            if self._fold_tag in line:
                self._fold.append(line)
                return True
            self._end_fold()
        if self.stopping and ABORT_BLOCK_START in line:
            # the logger's location tag, ``[async_llm.py:906]``, marks every line of the block
            head = line.split(ABORT_BLOCK_START, 1)[0].rstrip()
            self._fold_tag = head[head.rfind("[") :] if head.endswith("]") and "[" in head else ABORT_BLOCK_START
            self._fold = [line]
            return True
        return False

    def _end_fold(self) -> None:
        block, self._fold = self._fold, []
        if any(ABORT_BLOCK_END in line for line in block):
            self._folded += len(block)
            return
        for held in block:
            self._say(held)

    async def _wait(self) -> None:
        # Polled, not ``await proc.wait()``: that also waits for the output pipe to close, which a
        # grandchild still holding it (vLLM's engine core) delays for as long as it lives.
        assert self.proc is not None
        polls = 0
        while (code := self.proc.returncode) is None:
            if polls % MEMBER_POLLS == 0:
                self._watch_members()
            polls += 1
            await asyncio.sleep(POLL_S)
        self.returncode = code
        # a leader killed by a signal was killed (the signal says why); one that exited by itself may have
        # done so because a process of its group ended first (vLLM's API server after its EngineCore)
        self.first_lost = cause_of_exit(self._gone, time.monotonic()) if code >= 0 else None
        self.on_exit(self)

    def _watch_members(self) -> None:
        """Note the first process of the group that ends before its leader (vLLM's EngineCore, say), so
        that the leader's exit can be reported with its cause."""
        assert self.proc is not None
        members = group_members(self.proc.pid)
        if members is None:
            return
        # only while the leader itself still runs (it is listed): a group that ends after its leader was
        # killed is not a cause, and the leader's exit may not be reaped here yet
        if self.proc.pid in members:
            now = time.monotonic()
            for pid in sorted(set(self._members) - set(members) - {self.proc.pid}):
                self._gone.append((now, pid, self._members[pid]))
        self._members = members

    def describe_exit(self) -> str:
        """How the leader ended, and which process of its group ended first when one did."""
        how = describe_exit(self.returncode if self.returncode is not None else -1)
        if self.first_lost is not None:
            pid, name = self.first_lost
            how += f", after {name} (pid {pid}) of its process group had ended"
        return how

    def survivors(self) -> str:
        """The live processes of the role's group, as ``name (pid N)``, for a message."""
        members = group_members(self.pid) if self.proc is not None else None
        return ", ".join(f"{name} (pid {pid})" for pid, name in sorted((members or {}).items())) or "none"

    async def _poll_ready_file(self, path: Path) -> None:
        while not self.ready.is_set():
            if path.exists():
                self.ready.set()
                return
            await asyncio.sleep(POLL_S)

    async def _poll_health(self) -> None:
        url = f"http://{self.spec.host}:{self.spec.port}/health"
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self.ready.is_set():
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            self.ready.set()
                            return
                await asyncio.sleep(POLL_S * 2)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the role's whole process group (the leader may be gone, its children not)."""
        if self.proc is None:
            return
        self.stopping = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def alive(self) -> bool:
        return self.proc is not None and group_alive(self.proc.pid)

    async def close(self, drain_s: float = 0.5) -> None:
        """Stop the watchers; give the log pump ``drain_s`` to copy the last lines."""
        if self._tasks:
            pump, *watchers = self._tasks
            for task in watchers:
                task.cancel()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(pump, drain_s)
        if self._fold:
            self._end_fold()
        if self._folded:
            self._say(
                f"({self._folded} lines of vLLM's abort shutdown not shown: 'AsyncLLM output_handler failed' "
                "with EngineDeadError, its EngineCore stopped by serve first)"
            )
            self._folded = 0
        if self._noise:
            self._say(f"({self._noise} 'nanobind: leaked ...' lines at exit not shown: known shutdown noise)")
            self._noise = 0
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(task, return_exceptions=True)
