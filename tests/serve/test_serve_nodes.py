"""``afd-mrv2 serve`` over two nodes (Linux namespaces, tests/netns.py) with fake roles: start in any order,
the roles bind their node's address, and what a lost node, a killed serve, a stop or a cut link does.

Node 0 runs Attention 0 and FFN 0, hosts the store and the endpoint; node 1 runs Attention 1 and FFN 1.
Every request is sent from inside node 0.  Needs root (CI runs as root): a missing capability fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from tests.netns import Cluster, Node, require_namespaces
from tests.serve.nodes_support import (
    PORT,
    STOP_GRACE_S,
    NodeServe,
    afd_status,
    client_result,
    give_secret,
    only_init,
    send_completions,
    serve_args,
    start_client,
)

#: a process without the secret: a raw connection with a made-up proof and a request, then a member's client
#: with another secret; prints what each got
STRANGER = """
import datetime, socket, sys
from afd_mrv2.mrv2.transport.guarded_store import GuardedStore, StoreError
host, port = sys.argv[1], int(sys.argv[2])
raw = socket.create_connection((host, port), timeout=10)
raw.recv(33, socket.MSG_WAITALL)
raw.sendall(bytes(48) + b'{"op": "check", "keys": ["afd_mrv2/p2p/stop"]}')
try:
    print("nothing" if raw.recv(4096) == b"" else "data")
except ConnectionResetError:
    print("nothing")
try:
    GuardedStore(host, port, secret=bytes(32), master=False, timeout=datetime.timedelta(seconds=5))
    print("admitted")
except StoreError:
    print("refused")
"""
#: a node silent this long is lost (afd_mrv2.serve.remote.NODE_SILENT_S), seen from either side
SILENT_S = 5.0
#: how long the link is cut
CUT_S = 8.0


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    require_namespaces()
    with Cluster(2) as c:
        give_secret(c)
        yield c


def start_both(cluster: Cluster, *extra: str, behaviour: dict[str, object] | None = None) -> list[NodeServe]:
    """Serve on node 1, then on node 0; both ready (node 0's ready line) and node 1 joined."""
    serves = [NodeServe(cluster.nodes[k], serve_args(cluster, k, *extra), behaviour) for k in (1, 0)][::-1]
    serves[0].wait_ready()
    serves[1].wait_for("joined: this node runs ffn 1, attention 1", 5)
    return serves


def lost_within(serve: NodeServe, node: Node, since: float, within: float) -> float:
    """Node 0's serve says ``node`` is lost; how long after ``since`` (AssertionError after ``within``)."""
    lost = rf"\[serve\] node 1 \({re.escape(node.addr)}, host node1\) is silent for \d+\.\d s: every role on it is lost"
    at, line = serve.wait_for(re.compile(lost), within + 2)
    assert at - since <= within, f"{line!r} came {at - since:.1f} s after the fault"
    return at - since


def assert_stopped_naming(serve0: NodeServe, node1: Node) -> None:
    """Node 0's serve's last line: it stopped every role because a role of node 1 exited with its node lost."""
    name = rf"node 1 \({re.escape(node1.addr)}, host node1\)"
    pattern = (
        rf"afd-mrv2 serve: error: (attention|ffn) rank 1 \(pid \d+ on {name}\) exited \({name} silent for "
        r"\d+\.\d s\); stopped every role( \(lost earlier: attention rank 1 \(pid \d+ on node 1 .*\)\))?"
    )
    assert re.fullmatch(pattern, serve0.err_lines()[-1]), serve0.tail()


def test_two_nodes_serve_with_both_engines_and_bind_their_own_addresses(cluster):
    """Ready over two nodes; requests from node 0 reach both engines; /afd/status shows node 1 and every role
    live; each role runs on its node and binds that node's address, and no role's argv names loopback."""
    node0 = cluster.nodes[0]
    serve0, serve1 = start_both(cluster)
    url = f"http://{node0.addr}:{PORT}"
    results = send_completions(node0, url, 8)
    assert [r["status"] for r in results] == [200] * 8, results
    assert {r["rank"] for r in results} == {0, 1}, results
    status = afd_status(node0, url)
    assert status["nodes"] == {"1": "live"}, status
    assert status["live"] == {"attention": [0, 1], "ffn": [0, 1]} and status["ready"] is True, status
    assert all(role["live"] for role in status["roles"]) and len(status["roles"]) == 4, status
    # each role ran where the layout says, bound its own node's address, and nothing names loopback
    argvs = {}
    for serve in (serve0, serve1):
        for line in serve.err_lines():
            if "] argv " in line:
                argvs[line[1 : line.index("]")]] = (serve.node, json.loads(line.split("] argv ", 1)[1]))
            if "] started pid " in line:
                assert "127.0.0.1" not in line, line
    assert {name: node.name for name, (node, _) in argvs.items()} == {
        "attention 0": "node0",
        "ffn 0": "node0",
        "attention 1": "node1",
        "ffn 1": "node1",
    }
    for name, (node, argv) in argvs.items():
        assert "127.0.0.1" not in json.dumps(argv), (name, argv)
        afd = json.loads(argv[argv.index("--additional-config") + 1])["afd"]
        role, rank = name.split()
        assert (afd["role"], afd["rank"], afd["host"]) == (role, int(rank), node0.addr), afd
        if name.startswith("attention"):
            assert argv[argv.index("--host") + 1] == node.addr, (name, argv)
    # a stranger on node 1 (no secret) reaches the store's port: it gets the challenge only, and node 0 logs it
    store_port = json.loads(argvs["ffn 1"][1][argvs["ffn 1"][1].index("--additional-config") + 1])["afd"]["port"]
    done = cluster.nodes[1].run([sys.executable, "-c", STRANGER, node0.addr, str(store_port)], timeout=30)
    assert done.returncode == 0 and done.stdout.split() == ["nothing", "refused"], (done.stdout, done.stderr[-600:])
    refused = f"rendezvous store on {node0.addr}:{store_port}: refused a connection from {cluster.nodes[1].addr}: "
    serve0.wait_for(refused + "a wrong proof (not the deployment's secret)", 5)
    assert [r["status"] for r in send_completions(node0, url, 2)] == [200] * 2  # members unaffected
    serve0.proc.send_signal(signal.SIGTERM)
    assert serve0.wait(STOP_GRACE_S + 10) == 0
    assert serve1.wait(STOP_GRACE_S + 10) == 0


def test_nodes_started_in_any_order(cluster):
    """Node 1 first: it waits for node 0's store; node 0 a few seconds later; the deployment gets ready."""
    node0, node1 = cluster.nodes
    serve1 = NodeServe(node1, serve_args(cluster, 1))
    waiting_at, _ = serve1.wait_for("joining node 0's rendezvous store", 20)
    time.sleep(2.0)  # node 0 comes late on purpose
    assert serve1.proc.poll() is None and not any("joined:" in line for line in serve1.err_lines()), serve1.tail()
    started = time.monotonic()
    serve0 = NodeServe(node0, serve_args(cluster, 0))
    ready_at, url = serve0.wait_ready()
    joined_at, _ = serve1.wait_for("joined: this node runs ffn 1, attention 1", 5)
    assert joined_at >= started, "node 1 joined before node 0 started"
    results = send_completions(node0, url, 4)
    assert [r["status"] for r in results] == [200] * 4 and {r["rank"] for r in results} == {0, 1}, results
    print(f"node 1 waited {started - waiting_at:.1f} s; node 0 ready {ready_at - started:.1f} s after its start")
    serve0.proc.send_signal(signal.SIGTERM)
    assert serve0.wait(STOP_GRACE_S + 10) == 0
    assert serve1.wait(STOP_GRACE_S + 10) == 0


def test_a_killed_node_without_replicas_stops_node_0_naming_it(cluster):
    """Node 1 killed whole, no replicas: node 0 loses it, stops every role and exits 1 naming node 1."""
    node0, node1 = cluster.nodes
    serve0, _ = start_both(cluster)
    killed = time.monotonic()
    node1.kill()
    assert serve0.wait(15) == 1
    exited = time.monotonic() - killed
    assert_stopped_naming(serve0, node1)
    lost_within(serve0, node1, killed, SILENT_S + 3)
    empty = only_init(node0, STOP_GRACE_S + 10 - (time.monotonic() - killed))
    print(f"node 1 killed: node 0's serve exited 1 after {exited:.1f} s, node 0 empty {empty:.1f} s later")


def test_a_killed_node_with_replicas_is_lost_and_node_0_serves_on(cluster):
    """Node 1 killed whole, --expert-replicas 2: node 0 loses it, fails its roles over and serves on with
    engine 0; /afd/status says node 1 is lost and lists its roles as degraded."""
    node0, node1 = cluster.nodes
    serve0, _ = start_both(cluster, "--expert-replicas", "2")
    url = f"http://{node0.addr}:{PORT}"
    killed = time.monotonic()
    node1.kill()
    lost = lost_within(serve0, node1, killed, 10)
    serve0.wait_for("its experts are served by their other holders, FFN rank(s) 0 (1 of 2 live)", 3)
    serve0.wait_for("the endpoint serves on with attention 0 (1 of 2 Attention engines)", 3)
    results = send_completions(node0, url, 4)
    assert [(r["status"], r["rank"]) for r in results] == [(200, 0)] * 4, results
    status = afd_status(node0, url)
    assert re.fullmatch(r"lost: silent for \d+\.\d s", status["nodes"]["1"]), status
    assert status["degraded"] == ["attention 1", "ffn 1"], status
    assert status["live"] == {"attention": [0], "ffn": [0]} and status["ready"] is True, status
    assert serve0.proc.poll() is None
    print(f"node 1 killed: lost after {lost:.1f} s, node 0 serves on")
    serve0.proc.send_signal(signal.SIGTERM)
    assert serve0.wait(STOP_GRACE_S + 10) == 0


def test_sigterm_to_node_0_stops_both_nodes(cluster):
    """SIGTERM to node 0's serve: node 1's serve stops its roles and exits 0, both nodes end empty."""
    node0, node1 = cluster.nodes
    serve0, serve1 = start_both(cluster)
    signalled = time.monotonic()
    serve0.proc.send_signal(signal.SIGTERM)
    assert serve1.wait(STOP_GRACE_S + 10) == 0
    assert serve0.wait(STOP_GRACE_S + 10) == 0
    assert "[serve node 1] node 0 stops the deployment" in serve1.err_lines(), serve1.tail()
    assert serve1.err_lines()[-1] == "[serve node 1] stopped this node's roles", serve1.tail()
    assert serve0.err_lines()[-1] == "[serve] stopped every role (SIGTERM)", serve0.tail()
    for node in (node0, node1):
        only_init(node, STOP_GRACE_S + 10 - (time.monotonic() - signalled))
    print(f"SIGTERM to node 0: both nodes empty after {time.monotonic() - signalled:.1f} s")


def test_a_sigkilled_node_1_serve_leaves_no_role_and_node_0_stops(cluster):
    """SIGKILL to node 1's serve (not its node): its reaper stops its roles' groups (the fakes' grandchildren
    too); node 0 hears no more beats, loses node 1 and, without replicas, exits 1 naming it."""
    node0, node1 = cluster.nodes
    serve0, serve1 = start_both(cluster, behaviour={"grandchild": True})
    assert len(set(node1.pids()) - {node1.init_pid}) >= 6, node1.pids()  # serve, reaper, 2 roles, 2 grandchildren
    killed = time.monotonic()
    os.kill(serve1.host_pid(), signal.SIGKILL)
    assert serve1.wait(5) == -signal.SIGKILL
    only_init(node1, 10 - (time.monotonic() - killed))
    gone = time.monotonic() - killed
    _, reaped = serve1.wait_for("afd-mrv2 serve reaper: ", 2)
    assert "is gone; stopped the process groups of its roles" in reaped, reaped
    assert serve0.wait(15 - (time.monotonic() - killed)) == 1
    exited = time.monotonic() - killed
    lost_within(serve0, node1, killed, SILENT_S + 3)
    assert_stopped_naming(serve0, node1)
    only_init(node0, STOP_GRACE_S + 10 - (time.monotonic() - killed))
    print(f"node 1's serve SIGKILLed: its roles gone after {gone:.1f} s, node 0 exited 1 after {exited:.1f} s")


def test_a_cut_link_loses_node_1_for_good(cluster):
    """Node 1's cable is out for 8 s (--expert-replicas 2): requests get an answer or an error, never a hang;
    node 0 loses node 1 and serves on; after the cable is back node 1 stays lost (a lost node does not rejoin,
    by design for now); node 1 noticed node 0's silence while the cable was out, stopped its roles and exits 1."""
    node0, node1 = cluster.nodes
    serve0, serve1 = start_both(cluster, "--expert-replicas", "2")
    url = f"http://{node0.addr}:{PORT}"
    cut = time.monotonic()
    node1.link(False)
    time.sleep(1.0)  # the requests go out with the cable already cut
    results = client_result(start_client(node0, url, 4), 12)
    assert len(results) == 4 and all(r["elapsed"] < 10 for r in results), results
    lost = lost_within(serve0, node1, cut, 10)
    time.sleep(max(0.0, cut + CUT_S - time.monotonic()))
    node1.link(True)
    up = time.monotonic()
    time.sleep(1.5)  # three of node 0's looks at the nodes' beats with the cable back
    status = afd_status(node0, url)
    assert status["nodes"]["1"].startswith("lost: silent for "), status
    assert [(r["status"], r["rank"]) for r in send_completions(node0, url, 2)] == [(200, 0)] * 2
    silent = rf"afd-mrv2 serve: error: node 0 \({re.escape(node0.addr)}:\d+\) is silent for \d+\.\d s; stopped node 1's roles"
    said_at, _ = serve1.wait_for(re.compile(silent), max(0.0, up + 5 - time.monotonic()))
    assert said_at <= up, f"node 1 said node 0 is silent only {said_at - cut:.1f} s after the cut ({CUT_S:g} s)"
    assert serve1.wait(5) == 1
    print(
        f"link cut: requests answered within {max(r['elapsed'] for r in results):.1f} s, node 0 lost node 1 after "
        f"{lost:.1f} s, node 1 said node 0 is silent after {said_at - cut:.1f} s"
    )
    serve0.proc.send_signal(signal.SIGTERM)
    assert serve0.wait(STOP_GRACE_S + 10) == 0
