"""Stopping a deployment over two machines on real vLLM: nothing of it outlives its serves (issue 28, Stop).

2A2F over two namespace nodes, ``--expert-replicas 2``, the tiny Mixtral checkpoint in fp32 (tests/netns.py
hosts, as tests/vllm/test_serve_nodes.py).  Two deployments, one after the other:

* both nodes serving, SIGTERM to node 0's serve: both serves exit 0, and neither node runs anything but its
  init within the stop grace + 10 s (vLLM's EngineCore and workers included);
* SIGKILL to node 1's serve process: its reaper ends its roles (no process of node 1's roles after 10 s), node 0
  loses node 1 and serves on; then SIGKILL to node 0's serve: node 0 runs nothing but its init within 10 s.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.netns import Cluster, Node, require_namespaces
from tests.serve.nodes_support import only_init
from tests.vllm.harness import make_model
from tests.vllm.test_serve_nodes import PORT, NodeServe, answers, start_two_nodes

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1500)]

STOP_GRACE_S = 5.0  # NodeServe's --stop-grace-s
LOST = r"\[serve\] node 1 .* is silent for \d+\.\d s: every role on it is lost"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("stop") / "mixtral", "mixtral")


def start_both(cluster: Cluster, model: Path) -> tuple[NodeServe, NodeServe]:
    """Both nodes' serves; node 0 ready and answering."""
    first, second = start_two_nodes(cluster, model)
    node0 = cluster.nodes[0]
    assert all(a[0] == 200 for a in answers(node0, f"http://{node0.addr}:{PORT}", model, n=4))
    return first, second


def serve_pid(node: Node) -> int:
    """The host pid of the node's ``afd-mrv2 serve`` process (not its client, reaper or roles)."""
    for pid in node.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:4] == [b"-m", b"afd_mrv2.cli", b"serve"]:
            return pid
    raise AssertionError(f"no serve process on {node.name}")


def test_sigterm_to_node_0_stops_both_nodes(model: Path) -> None:
    require_namespaces()
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        first, second = start_both(cluster, model)
        assert len(node1.pids()) > 4, node1.pids()  # its serve, reaper, roles and vLLM's processes
        stopped = time.monotonic()
        assert first.stop(timeout=STOP_GRACE_S + 10) == 0
        assert second.proc.wait(STOP_GRACE_S + 10) == 0
        only_init(node0, STOP_GRACE_S + 10 - (time.monotonic() - stopped))
        only_init(node1, STOP_GRACE_S + 10 - (time.monotonic() - stopped))
        print(f"SIGTERM to node 0: both serves exited 0, both nodes empty {time.monotonic() - stopped:.1f} s after it")


def test_sigkill_to_either_serve_leaves_none_of_its_roles(model: Path) -> None:
    require_namespaces()
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        first, _ = start_both(cluster, model)
        killed = time.monotonic()
        os.kill(serve_pid(node1), signal.SIGKILL)
        only_init(node1, 10.0)
        gone1 = time.monotonic() - killed
        while first.said(LOST) is None and time.monotonic() < killed + 15:
            time.sleep(0.2)
        lost_at = first.said(LOST)
        assert lost_at is not None, "\n".join(first.err.lines[-40:])
        assert all(a[0] == 200 for a in answers(node0, f"http://{node0.addr}:{PORT}", model, n=4))
        assert first.proc.poll() is None
        killed0 = time.monotonic()
        os.kill(serve_pid(node0), signal.SIGKILL)
        only_init(node0, 10.0)
        print(
            f"SIGKILL to node 1's serve: node 1 empty after {gone1:.1f} s, node 0 lost node 1 after "
            f"{lost_at - killed:.1f} s and served on; SIGKILL to node 0's serve: node 0 empty after "
            f"{time.monotonic() - killed0:.1f} s"
        )
