"""``afd-mrv2 serve`` over two machines on real vLLM: two hosts made of namespaces (tests/netns.py).

2 Attention + 2 FFN ranks over 2 nodes (A0, F0 on node 0; A1, F1 on node 1), ``--expert-replicas 2``, the tiny
Mixtral checkpoint in fp32, V1 CPU runner, the default transport (tcp).  Each node has its own network, PID
namespace, host name and temporary directory, so a loopback literal, a hostname fallback, a cross-node
``/proc`` read or a shared run directory fails it.  Requests are sent from inside node 0.

* the same 2A2F serve on node 0 alone answers 32 greedy completions first (the single-host reference);
* over two nodes: 32/32 identical to it, max |logprob difference| <= 1e-5; node 1's TCP connections reach
  node addresses only, node 0's among them (the cross-node pairs);
* FFN rank 1 (node 1) SIGKILLed while 32 requests run: all complete, >= 31/32 identical (max |dlogprob| <= 1e-4,
  the failed-over items sum their partials in another order), and node 0 restarts it on node 1;
* node 1 killed whole (its PID namespace's init): node 0 says node 1 is lost within 10 s, and serves on
  (every later request answered by Attention rank 0);
* SIGTERM to node 0's serve: it exits 0 and leaves no process on node 0 within its stop grace + 10 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2.harness.client import compare
from afd_mrv2.harness.servers import ENGINE_ARGS
from tests.netns import Cluster, Node, require_namespaces
from tests.vllm.harness import make_model

#: the full matrix (330 s): CI's reduced one keeps its budget; the two-node logic (join, loss, retry) runs in the
#: unit run on fake roles (tests/serve/test_serve_nodes.py)
pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1500)]

READY = "afd-mrv2 serve: ready at"
START_S = 600.0
PORT = 18000
CLIENT = """
import json, sys
from afd_mrv2.harness.client import body, complete_all, greedy, prompts
url, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
answers = complete_all(url, [body(model, p, 32, logprobs=1, return_token_ids=True) for p in prompts(n)])
print(json.dumps([[s, greedy(a) if s == 200 else str(a)[:300], a.get("pid") if isinstance(a, dict) else None]
                  for s, a in answers]))
"""


class Lines:
    """Every line of a pipe with its arrival time (monotonic), read by a daemon thread."""

    def __init__(self, pipe: Any) -> None:
        self.timed: list[tuple[float, str]] = []
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: Any) -> None:
        for line in pipe:
            self.timed.append((time.monotonic(), line.rstrip("\n")))

    @property
    def lines(self) -> list[str]:
        return [line for _, line in self.timed]


class NodeServe:
    """``afd-mrv2 serve`` on one node, its stdout and stderr read line by line."""

    def __init__(self, node: Node, model: Path, *args: str) -> None:
        argv = [sys.executable, "-m", "afd_mrv2.cli", "serve", str(model), "--attention", "2", "--ffn", "2"]
        argv += ["--attention-groups", "2"]  # two independent engines, one on each node
        argv += ["--expert-replicas", "2", "--port", str(PORT), "--stop-grace-s", "5", *args]
        argv += ["--", *ENGINE_ARGS]  # fp32, as every equivalence test: a bound of 1e-4 means something
        self.proc = node.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out, self.err = Lines(self.proc.stdout), Lines(self.proc.stderr)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while not any(line.startswith(READY) for line in self.out.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("serve not ready:\n" + "\n".join(self.err.lines[-60:]))
            time.sleep(0.5)

    def said(self, pattern: str) -> float | None:
        """When (monotonic) a stderr line matching ``pattern`` arrived; None if none did."""
        return next((t for t, line in self.err.timed if re.search(pattern, line)), None)

    def stop(self, timeout: float = 30.0) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout)


def answers(node: Node, url: str, model: Path, n: int = 32) -> list[list[Any]]:
    done = node.run([sys.executable, "-c", CLIENT, url, str(model), str(n)], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def greedy_of(got: list[list[Any]]) -> list[Any]:
    bad = [a for a in got if a[0] != 200]
    assert not bad, bad[:3]
    return [tuple(a[1]) for a in got]


def peers(node: Node) -> set[str]:
    """The remote addresses of the node's established TCP connections."""
    lines = node.run(["ss", "-tnH", "state", "established"]).stdout.splitlines()
    hosts = {line.split()[-1].rsplit(":", 1)[0].strip("[]") for line in lines if line.strip()}
    return {h.removeprefix("::ffff:") for h in hosts}  # an IPv4 peer of a dual-stack socket


def kill_group(node: Node, inner: int) -> None:
    """SIGKILL the process group of the process whose pid inside ``node``'s PID namespace is ``inner``."""
    for pid in node.pids():
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        nspids = next(line for line in status if line.startswith("NSpid:")).split()[1:]
        if int(nspids[-1]) == inner:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no process with pid {inner} on {node.name}")


def kill_ffn_mid_stream(
    first: NodeServe, node0: Node, node1: Node, url: str, model: Path, reference: list[Any]
) -> None:
    """FFN rank 1 (node 1) SIGKILLed while 32 requests run: every one completes, as plain as before, and node 0
    restarts it on node 1."""
    inner = next(int(m[1]) for line in first.err.lines if (m := re.search(r"ffn rank 1 \(pid (\d+) on node 1", line)))
    result: list[Any] = []
    client = threading.Thread(target=lambda: result.extend(answers(node0, url, model)))
    client.start()
    time.sleep(1.0)
    killed = time.monotonic()
    kill_group(node1, inner)
    client.join(600)
    versus = compare(greedy_of(result), reference)
    print(f"FFN rank 1 killed mid-stream: {versus}")
    assert versus["identical"] >= 31 and versus["max_logprob_diff"] <= 1e-4, versus
    deadline = killed + 300
    while first.said(r"ffn rank 1 \(pid \d+ on node 1 .*\) restarted") is None and time.monotonic() < deadline:
        time.sleep(0.5)
    back = first.said(r"ffn rank 1 \(pid \d+ on node 1 .*\) restarted")
    assert back is not None, "\n".join(first.err.lines[-40:])
    print(f"FFN rank 1 restarted on node 1 {back - killed:.1f} s after its kill")
    again = answers(node0, url, model, n=8)  # served with it back (the engines take it back at a step boundary)
    assert all(a[0] == 200 for a in again), [a for a in again if a[0] != 200][:2]


def start_two_nodes(cluster: Cluster, model: Path) -> tuple[NodeServe, NodeServe]:
    """Serve on node 1, then on node 0 (every node given the same secret file); node 0 ready."""
    node0, node1 = cluster.nodes
    secret = os.urandom(32).hex()
    for node in cluster.nodes:
        (node.tmp / "secret").write_text(secret)
    common = ("--nnodes", "2", "--master-addr", node0.addr, "--host", node0.addr)
    second = NodeServe(node1, model, *common, "--node-rank", "1", "--secret-file", str(node1.tmp / "secret"))
    first = NodeServe(node0, model, *common, "--node-rank", "0", "--secret-file", str(node0.tmp / "secret"))
    first.wait_ready()
    return first, second


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("nodes") / "mixtral", "mixtral")


def test_two_nodes_equal_one_and_survive_the_loss_of_a_node(model: Path) -> None:
    require_namespaces()
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        url = f"http://{node0.addr}:{PORT}"
        alone = NodeServe(node0, model, "--host", node0.addr)
        alone.wait_ready()
        reference = greedy_of(answers(node0, url, model))
        assert alone.stop() == 0

        first, second = start_two_nodes(cluster, model)
        got = greedy_of(answers(node0, url, model))
        versus = compare(got, reference)
        print(f"two nodes vs one: {versus}")
        assert versus["identical"] == 32 and versus["max_logprob_diff"] <= 1e-5, versus
        seen = peers(node1)
        print(f"node 1's TCP peers: {sorted(seen)}")
        assert node0.addr in seen and seen <= {node0.addr, node1.addr, "127.0.0.1", "::1"}, seen
        kill_ffn_mid_stream(first, node0, node1, url, model, reference)

        killed = time.monotonic()
        node1.kill()
        deadline = killed + 10.0
        while (
            first.said(r"node 1 .* is silent for .*: every role on it is lost") is None and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        lost_at = first.said(r"node 1 .* is silent for .*: every role on it is lost")
        assert lost_at is not None and lost_at - killed <= 10.0, "\n".join(first.err.lines[-40:])
        print(f"node 1 lost {lost_at - killed:.1f} s after its kill")
        after = answers(node0, url, model, n=8)
        failed = [(a[0], a[1]) for a in after if a[0] != 200]
        retried = [line for line in first.err.lines if "cannot be reached" in line]
        print(
            f"after the loss: {len(after) - len(failed)}/{len(after)} answered; endpoint retries: {retried or 'none'}"
        )
        assert not failed, f"{failed[:2]}\n" + "\n".join(
            line for line in first.err.lines[-80:] if "[serve]" in line or "rror" in line
        )
        assert first.proc.poll() is None

        stopped = time.monotonic()
        assert first.stop(timeout=40.0) == 0
        while len(node0.pids()) > 1 and time.monotonic() < stopped + 15.0:
            time.sleep(0.2)
        assert len(node0.pids()) <= 1, f"left on node 0: {node0.pids()}"
        assert second.proc.poll() is not None
