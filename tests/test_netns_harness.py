"""The namespace hosts of tests/netns.py do what they claim: separate networks joined by a switch,
separate PID namespaces, hostnames and temporary directories, partitions, whole-node kills, clean exits."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netns
from tests.netns import Cluster, Node, netns_list, require_namespaces

# argv: HOST PORT COUNT; accepts COUNT connections, prints "PEER_IP DATA" for each.
SERVE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
for _ in range(int(sys.argv[3])):
    conn, peer = server.accept()
    print(peer[0], conn.recv(64).decode(), flush=True)
    conn.close()
"""

# argv: HOST PORT TIMEOUT DATA; prints "connected" or the error's class name.
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        conn.sendall(sys.argv[4].encode())
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""


def serve(node: Node, host: str, port: int, count: int) -> subprocess.Popen[str]:
    proc = node.popen([sys.executable, "-c", SERVE, host, str(port), str(count)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 10.0)
    assert ready and proc.stdout.readline().strip() == "listening", f"no server on {node.name} {host}:{port}"
    return proc


def connect(node: Node, host: str, port: int, *, timeout: float = 5.0) -> str:
    done = node.run([sys.executable, "-c", CONNECT, host, str(port), str(timeout), node.name], timeout=timeout + 10)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def accepted(server: subprocess.Popen[str]) -> list[str]:
    out, _ = server.communicate(timeout=10)
    return out.splitlines()


def wait_until(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def pair() -> Iterator[Cluster]:
    with Cluster(2) as cluster:
        yield cluster


def test_every_node_reaches_every_other_node_at_its_address() -> None:
    with Cluster(3) as c:
        servers = [serve(node, node.addr, 7000, len(c.nodes) - 1) for node in c.nodes]
        for dst in c.nodes:
            for src in c.nodes:
                if src is not dst:
                    assert connect(src, dst.addr, 7000) == "connected", f"{src.name} -> {dst.name}"
        for dst, server in zip(c.nodes, servers, strict=True):
            expected = {f"{src.addr} {src.name}" for src in c.nodes if src is not dst}
            assert set(accepted(server)) == expected
        assert len({node.addr for node in c.nodes}) == 3


def test_loopback_is_each_nodes_own(pair: Cluster) -> None:
    node0, node1 = pair.nodes
    server = serve(node0, "127.0.0.1", 7001, 1)
    assert connect(node1, "127.0.0.1", 7001) == "ConnectionRefusedError"  # node1's lo is up, nothing listens there
    assert connect(node1, node0.addr, 7001) == "ConnectionRefusedError"  # bound to loopback only
    assert connect(node0, "127.0.0.1", 7001) == "connected"
    assert accepted(server) == ["127.0.0.1 node0"]


def test_hostname_is_each_nodes_own(pair: Cluster) -> None:
    for node in pair.nodes:
        assert node.run(["hostname"]).stdout.strip() == node.name
        done = node.run(
            [sys.executable, "-c", "import os, socket; print(socket.gethostname(), os.environ['HOSTNAME'])"]
        )
        assert done.stdout.split() == [node.name, node.name]
    assert pair.nodes[0].name != pair.nodes[1].name


def test_proc_shows_only_the_nodes_own_processes(pair: Cluster) -> None:
    node0, node1 = pair.nodes
    sleeper = node0.popen(["sleep", "30"])
    try:
        wait_until(lambda: len(node0.pids()) == 2)
        lister = "import os; print(os.getpid(), *sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
        own, *visible = map(int, node1.run([sys.executable, "-c", lister]).stdout.split())
        assert visible == [1, own] and own < 100
        init_cmdline = node1.run(["cat", "/proc/1/cmdline"]).stdout.split("\0")
        assert init_cmdline[3:5] == ["init", "node1"]  # the init of node1's PID namespace, not the host's
        host_pids = set(node0.pids()) - {node0.init_pid}
        assert len(host_pids) == 1 and Path(f"/proc/{host_pids.pop()}/cmdline").read_bytes() == b"sleep\x0030\x00"
    finally:
        sleeper.kill()
        sleeper.wait(5)


def test_tmpdir_and_cwd(pair: Cluster, tmp_path: Path) -> None:
    show = "import os, tempfile; print(os.environ['TMPDIR'], tempfile.gettempdir(), os.getcwd())"
    for node in pair.nodes:
        done = node.run([sys.executable, "-c", show], cwd=tmp_path, env={"TMPDIR": "/not/this"})
        assert done.stdout.split() == [str(node.tmp), str(node.tmp), str(tmp_path)]
        assert node.tmp.is_dir()
    node0, node1 = pair.nodes
    assert node0.tmp != node1.tmp
    node1.run(["sh", "-c", 'echo hi > "$TMPDIR/mark"'])
    assert (node1.tmp / "mark").read_text() == "hi\n" and not (node0.tmp / "mark").exists()


def test_popen_passes_signals_to_the_command(pair: Cluster) -> None:
    node0 = pair.nodes[0]
    waits = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\nprint('ready', flush=True)\ntime.sleep(30)"
    proc = node0.popen([sys.executable, "-c", waits], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.terminate()
    assert proc.wait(5) == 3  # the command's handler ran: SIGTERM reached it, its exit status came back
    sleeper = node0.popen(["sh", "-c", "sleep 30 & exec sleep 31"])
    wait_until(lambda: len(node0.pids()) == 3)
    inner = set(node0.pids()) - {node0.init_pid}
    sleeper.kill()  # the client: the init then kills the command's process group, its background child too
    assert sleeper.wait(5) == -signal.SIGKILL
    wait_until(lambda: all(gone(pid) for pid in inner))
    assert node0.pids() == [node0.init_pid]


def test_link_down_partitions_the_node_and_link_up_restores_it() -> None:
    with Cluster(2) as c:
        node0, node1 = c.nodes
        server = serve(node1, node1.addr, 7002, 3)
        assert connect(node0, node1.addr, 7002) == "connected"
        node1.link(False)
        assert connect(node0, node1.addr, 7002, timeout=0.5) == "TimeoutError"
        assert connect(node1, node0.addr, 7003, timeout=0.5) == "TimeoutError"  # not refused: nothing gets through
        assert connect(node1, node1.addr, 7002) == "connected"  # the node's own stack still works
        node1.link(True)
        assert connect(node0, node1.addr, 7002) == "connected"
        assert connect(node1, node0.addr, 7003) == "ConnectionRefusedError"
        assert accepted(server) == [f"{node0.addr} node0", f"{node1.addr} node1", f"{node0.addr} node0"]


def test_kill_ends_every_process_of_the_node() -> None:
    with Cluster(2) as c:
        node0, node1 = c.nodes
        other = node0.popen(["sleep", "60"])
        sleepers = [node1.popen(["sleep", "60"]), node1.popen(["sh", "-c", "sleep 60 & exec sleep 61"])]
        wait_until(lambda: len(node1.pids()) == 4)  # the init and three sleeps (one in the background)
        before = node1.pids()
        node1.kill()
        assert node1.pids() == []
        assert all(gone(pid) for pid in before)
        assert [proc.returncode for proc in sleepers] == [-signal.SIGKILL, -signal.SIGKILL]
        assert other.poll() is None and len(node0.pids()) == 2  # node0 untouched
        with pytest.raises(RuntimeError, match="node1 is down"):
            node1.popen(["true"])
        node1.start()
        assert node1.run(["hostname"]).stdout.strip() == "node1"
        assert node1.pids() == [node1.init_pid] and node1.init_pid not in before


def test_exit_removes_namespaces_processes_and_directories_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="the body failed"), Cluster(2) as c:
        names = [node.netns for node in c.nodes] + [c.switch]
        tmps = [node.tmp for node in c.nodes]
        assert set(names) <= set(netns_list())
        c.nodes[0].popen(["sleep", "60"])
        wait_until(lambda: len(c.nodes[0].pids()) == 2)
        pids = c.nodes[0].pids() + c.nodes[1].pids()
        raise RuntimeError("the body failed")
    assert not set(names) & set(netns_list())
    assert not any(tmp.exists() for tmp in tmps)
    assert all(gone(pid) for pid in pids)


def test_failed_setup_removes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Node] = []
    inits: list[int] = []
    real_start = Node.start

    def start_once(node: Node, timeout: float = 10.0) -> None:
        if started:
            raise AssertionError("refused")
        real_start(node, timeout)
        started.append(node)
        inits.append(node.init_pid)

    monkeypatch.setattr(Node, "start", start_once)
    cluster = Cluster(2)
    with pytest.raises(AssertionError, match="refused"), cluster:
        pass
    assert not [name for name in netns_list() if name.startswith(cluster.prefix)]
    assert not list(Path(started[0].tmp).parent.glob(f"{cluster.prefix}-*"))
    assert started[0].pids() == [] and gone(inits[0])


def test_require_namespaces_fails_naming_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    require_namespaces()  # CI runs as root with ip and unshare
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AssertionError, match=r"`ip` command on PATH, the `unshare` command"):
        require_namespaces()
    with pytest.raises(AssertionError, match="unshare"), Cluster(1):
        pass
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(AssertionError, match=r"root \(running as uid 1000\)"):
        require_namespaces()
