"""Hosts made of Linux namespaces, for tests of a deployment over several machines on one.

``with Cluster(n) as c:`` makes n nodes.  Node k is:

* a network namespace ``afd-<pid>-<seq>-<k>`` with ``lo`` up and ``eth0`` at
  ``10.<a>.<b>.<k+1>/24`` (the subnet derived from the test process's pid and a
  per-process sequence number); every ``eth0`` is one end of a veth pair whose
  other end, ``v<k>``, is a port of the bridge ``br0`` in an extra "switch"
  namespace ``afd-<pid>-<seq>-sw``;
* ONE PID namespace (and UTS and mount namespace) per node: its init is this file
  run as a script (``python -I netns.py init node<k> SOCKET``), started as ``ip
  netns exec NS unshare --pid --fork --kill-child --mount-proc --uts``.  The init
  sets the hostname to ``node<k>``, reaps orphans, and spawns the node's commands:
  ``/proc`` inside shows the node's processes only;
* a temporary directory ``Node.tmp`` on the host filesystem, ``TMPDIR`` of every
  process started on the node.

``Node.popen`` starts a client on the host (``python -I netns.py run SOCKET --
ARGV``; the Popen's pid is the client's) that hands the init its argv,
environment, working directory and stdin/stdout/stderr over a unix socket; the
init forks the command (a session of its own) with them.  The client passes
SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and SIGCONT on to the command
and ends with the command's exit status (a command killed by a signal makes it
die of that signal); when the client dies (``Popen.kill()``) the init SIGKILLs the
command's process group.  So every process of a node descends from its init, no
process of the node has a parent on the host, and ``Node.kill()`` (SIGKILL to the
init) ends all of them (the kernel's rule for a PID namespace).  On exit (also
when the body raises, also when set-up fails half-way) the Cluster kills every
process of its namespaces, deletes them and removes its directories.  Namespaces a
test process left when it died (a killed pytest: its pid is in their names) are
deleted by the next Cluster.

A missing capability (not root, no ``ip`` or ``unshare``, namespace creation
refused) raises AssertionError: a test that needs the harness fails, never skips.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOOLS = ("ip", "unshare")
PREFIX = "afd"
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)
# what Python (the init) sets for these signals is not the command's: the command starts with the defaults
_PYTHON_SIGNALS = (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD)
_SELF = str(Path(__file__).resolve())
_SEQ = itertools.count()


def require_namespaces() -> None:
    """Raise AssertionError naming what is missing for the harness: root, ``ip``, ``unshare``."""
    missing = [] if os.geteuid() == 0 else [f"root (running as uid {os.geteuid()})"]
    missing += [f"the `{tool}` command on PATH" for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise AssertionError(
            "the netns test harness needs " + ", ".join(missing) + " (a missing capability fails the test)"
        )


def sh(*argv: str, timeout: float = 10.0) -> str:
    """Run a set-up command on the host; its stdout, or AssertionError with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise AssertionError(f"`{' '.join(argv)}` failed with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def netns_list() -> list[str]:
    """The names of the host's named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _delete_netns(name: str) -> None:
    """SIGKILL every host process in network namespace ``name``, then delete the namespace."""
    for pid in sh("ip", "netns", "pids", name).split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    sh("ip", "netns", "delete", name)


def _sweep_stale() -> None:
    """Delete this harness's namespaces left by test processes that are gone (a killed pytest)."""
    for name in netns_list():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-(?:\d+|sw)", name)
        if match and not _alive(int(match[1])):
            _delete_netns(name)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _members(pidns: str) -> list[int]:
    """Host pids of the processes whose PID namespace is ``pidns`` (a ``pid:[inode]`` link)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/pid") == pidns:
                    found.append(int(entry.name))
    return sorted(found)


class Node:
    """One host of a Cluster; see the module docstring."""

    def __init__(self, index: int, netns: str, switch: str, addr: str, tmp: Path, sock: Path) -> None:
        self.index = index
        self.name = f"node{index}"
        self.netns = netns
        self.addr = addr
        self.tmp = tmp
        self.init_pid = 0  # host pid of the init of the node's PID namespace; 0 while the node is down
        self._switch = switch
        self._sock = sock
        self._pidns = ""
        self._holder: subprocess.Popen[str] | None = None
        self._procs: list[subprocess.Popen[Any]] = []

    def start(self, timeout: float = 10.0) -> None:
        """Start the node's init (a fresh PID namespace); the Cluster does it, a test may after ``kill()``."""
        if self._holder is not None:
            raise RuntimeError(f"{self.name} is already running")
        self._sock.unlink(missing_ok=True)
        argv = ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
        argv += ["--uts", "--", sys.executable, "-I", _SELF, "init", self.name, str(self._sock)]
        holder = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None and holder.stderr is not None
        ready, _, _ = select.select([holder.stdout], [], [], timeout)
        line = holder.stdout.readline() if ready else ""
        children = _children(holder.pid)
        if line.strip() != "ready" or len(children) != 1:
            holder.kill()
            _, err = holder.communicate()
            raise AssertionError(f"{self.name}: the init of its PID namespace did not start ({line!r}): {err.strip()}")
        holder.stdout.close()
        holder.stderr.close()
        self._holder, self.init_pid = holder, children[0]
        self._pidns = os.readlink(f"/proc/{self.init_pid}/ns/pid")

    def popen(
        self, argv: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None, **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """``subprocess.Popen(argv)`` inside the node; the Popen is the host-side client (module docstring).

        The command's environment is os.environ, then ``env`` over it, then ``TMPDIR=Node.tmp`` and
        ``HOSTNAME=Node.name``; its working directory is ``cwd`` (default: the caller's); its
        stdin/stdout/stderr are the ones given.  ``pass_fds`` do not reach the command.
        """
        if self._holder is None:
            raise RuntimeError(f"{self.name} is down (killed); call start() first")
        full_env = {**os.environ, **(env or {}), "TMPDIR": str(self.tmp), "HOSTNAME": self.name}
        client = [sys.executable, "-I", _SELF, "run", str(self._sock), "--", *map(os.fspath, argv)]
        proc = subprocess.Popen(client, env=full_env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the node to its end; stdout and stderr as text.  On timeout: killed, TimeoutExpired."""
        proc = self.popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess([os.fspath(arg) for arg in argv], proc.returncode, out, err)

    def pids(self) -> list[int]:
        """Host pids of every process in the node's PID namespace (its init included while it runs)."""
        return _members(self._pidns) if self._pidns else []

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the node's init, so that every process of the node dies; return once all are gone.

        The clients of the node's commands then end as killed by SIGKILL (returncode -9).
        """
        if self._holder is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for proc in [*self._procs, self._holder]:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(1.0)
        while self.pids():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: processes {self.pids()} outlived the init of their PID namespace")
            time.sleep(0.01)
        self._holder, self._procs, self.init_pid = None, [], 0

    def link(self, up: bool) -> None:
        """Plug (True) or unplug (False) the node's cable at the switch: no traffic between it and the others.

        The switch's end of the node's veth goes down: ``eth0`` in the node keeps its address and
        reports NO-CARRIER, packets either way are lost silently (no reset, no unreachable), the
        node's loopback and its own address still work.
        """
        sh("ip", "-n", self._switch, "link", "set", f"v{self.index}", "up" if up else "down")


class Cluster:
    """``with Cluster(n) as c:``: n nodes (``c.nodes``) on one switch; see the module docstring."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a cluster has at least one node, not {n}")
        self.n = n
        seq = next(_SEQ)
        self.prefix = f"{PREFIX}-{os.getpid()}-{seq}"
        self.switch = f"{self.prefix}-sw"
        spread = (os.getpid() * 16 + seq) % (250 * 256)
        self.subnet = f"10.{1 + spread // 256}.{spread % 256}"
        self.nodes: list[Node] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Cluster:
        require_namespaces()
        _sweep_stale()
        try:
            self._build()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def _add_netns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self._stack.callback(_delete_netns, name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _mkdtemp(self, what: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-{what}-"))
        self._stack.callback(shutil.rmtree, path, ignore_errors=True)
        return path

    def _build(self) -> None:
        sockets = self._mkdtemp("ctl")  # the inits' unix sockets, apart from the nodes' TMPDIRs
        self._add_netns(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for k in range(self.n):
            netns = f"{self.prefix}-{k}"
            node = Node(k, netns, self.switch, f"{self.subnet}.{k + 1}", self._mkdtemp(f"node{k}"), sockets / f"{k}")
            self._add_netns(netns)
            sh("ip", "-n", self.switch, "link", "add", f"v{k}", "type", "veth", "peer", "name", "eth0", "netns", netns)
            sh("ip", "-n", self.switch, "link", "set", f"v{k}", "master", "br0", "up")
            sh("ip", "-n", netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            sh("ip", "-n", netns, "link", "set", "eth0", "up")
            self.nodes.append(node)
            self._stack.callback(node.kill)
            node.start()


# ---- run as a script: the init of a node (``init``) and the host-side client of one command (``run``) ----


def _exit_as(code: int) -> None:
    """End this process as a child that ended with ``code`` did (a negative code: killed by that signal)."""
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _client(path: str, argv: list[str]) -> None:
    """Have the node's init run ``argv`` with this process's environment, directory and stdio; end as it ends."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [request], [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: conn.send(str(signum).encode()))
    reply = conn.recv(64)
    _exit_as(os.waitstatus_to_exitcode(int(reply)) if reply else -signal.SIGKILL)  # no reply: the node was killed


def _spawn(request: dict[str, Any], fds: list[int]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for sig in _PYTHON_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                os.close(fd)
            os.chdir(request["cwd"])
            os.execvpe(request["argv"][0], request["argv"], request["env"])
        except BaseException as e:  # noqa: BLE001 - the forked child reports any failure and exits
            os.write(2, f"netns init: cannot run {request['argv']!r}: {e}\n".encode())
        os._exit(127)
    for fd in fds:
        os.close(fd)
    return pid


class _Init:
    """The init of a node's PID namespace: spawns what clients ask for, passes signals on, reaps all."""

    def __init__(self, path: str) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server.bind(path)
        self.server.listen(128)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.pid_of: dict[socket.socket, int] = {}  # client connection -> its command's pid (0: none yet)
        self.client_of: dict[int, socket.socket] = {}

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.server:
                    conn, _ = self.server.accept()
                    self.pid_of[conn] = 0
                    self.selector.register(conn, selectors.EVENT_READ)
                elif key.fileobj == self.wake_r:
                    os.read(self.wake_r, 4096)
                    self.reap()
                else:
                    self.receive(key.fileobj)  # type: ignore[arg-type]

    def receive(self, conn: socket.socket) -> None:
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        except OSError:
            message, fds = b"", []
        pid = self.pid_of[conn]
        if not message:  # the client is gone: so is its command
            self.drop(conn)
            if pid in self.client_of:
                del self.client_of[pid]
                for kill in (os.killpg, os.kill):  # its group, and itself should it not have called setsid() yet
                    with contextlib.suppress(ProcessLookupError):
                        kill(pid, signal.SIGKILL)
        elif pid == 0:
            pid = _spawn(json.loads(message), fds)
            self.pid_of[conn], self.client_of[pid] = pid, conn
        elif pid in self.client_of:
            os.kill(pid, int(message))

    def drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        del self.pid_of[conn]
        conn.close()

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.client_of.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(str(status).encode())
                self.drop(conn)


def _main(args: list[str]) -> None:
    if args[0] == "init":
        socket.sethostname(args[1])
        init = _Init(args[2])
        print("ready", flush=True)
        init.serve()
    elif args[0] == "run" and args[2] == "--":
        _client(args[1], args[3:])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} init HOSTNAME SOCKET | run SOCKET -- ARGV...")


if __name__ == "__main__":
    _main(sys.argv[1:])
