"""``afd-mrv2 serve`` over two nodes on real vLLM, node 1's cable out for 30 s (issue 28's partition item).

2 Attention + 2 FFN ranks over 2 namespace nodes (A0, F0 on node 0; A1, F1 on node 1), ``--expert-replicas 2``,
the tiny Mixtral checkpoint in fp32; requests from inside node 0.  A stream of greedy completions runs; 0.8 s in
(both engines' requests in flight), node 1's link goes down for 30 s (more requests start meanwhile), then up.

* no request (streamed) takes longer than the engines' ``recv_timeout_s`` + 5 s, wall time: node 0 marks node
  1's roles lost ~5 s into the cut and the engines drop those FFN ranks at once (``PeerLink.lose``), so the
  requests on Attention rank 0 fail over then, not at ``recv_timeout_s``;
* every error is a request to Attention rank 1 (node 1); every request Attention rank 0 took is answered;
* node 0 declares node 1 lost, says so in ``/afd/status`` after the cable is back, and answers new requests
  with rank 0 only; node 1's serve noticed node 0's silence during the cut and exited 1 on its own;
* SIGTERM to node 0's serve: exit 0, and neither node runs anything but its init within stop grace + 10 s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2.hooks.p2p.common import parse_options
from tests.netns import Cluster, Node, require_namespaces
from tests.serve.nodes_support import afd_status, only_init
from tests.vllm.harness import make_model
from tests.vllm.test_serve_nodes import PORT, NodeServe, answers, start_two_nodes

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1500)]

#: node 1's cable is out this long, from this long after the stream's start
CUT_S = 30.0
CUT_AFTER_S = 0.8
#: NodeServe's --stop-grace-s
STOP_GRACE_S = 5.0
#: the stream: (start, seconds after the stream's; max_tokens): 8 at once, long enough (~2 s) to be in flight
#: at the cut, then a short one every 2 s while the cable is out, and two once it is back in
STARTS = [(0.0, 96)] * 8 + [(CUT_AFTER_S + s, 24) for s in (*range(2, 30, 2), CUT_S + 1, CUT_S + 3)]
LOST = r"\[serve\] node 1 .* is silent for \d+\.\d s: every role on it is lost"

# A client run inside node 0: prints its start (monotonic: the host's clock, the nodes share it), then starts
# each request of STARTS (streamed) on a thread of its own; once all ended, prints per request [t0, t1, the
# longest it went without a byte, status, error or null] (an error event in the stream, too, is an error).
STREAM = """
import json, sys, threading, time, urllib.error, urllib.request
from afd_mrv2.harness.client import body, prompts
url, model, starts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = [None] * len(starts)
t_start = time.monotonic()
print(t_start, flush=True)
def one(i, prompt):
    time.sleep(max(0.0, t_start + starts[i][0] - time.monotonic()))
    t0 = last = time.monotonic()
    silent, status, error, done = 0.0, -1, None, False
    payload = json.dumps({**body(model, prompt, starts[i][1]), "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", payload, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            status = resp.status
            for raw in resp:
                now = time.monotonic()
                silent, last = max(silent, now - last), now
                line = raw.decode(errors="replace").strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                    error = line[6:406]
    except urllib.error.HTTPError as exc:
        status, error = exc.code, exc.read().decode(errors="replace")[:400]
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    t1 = time.monotonic()
    if error is None and not done:
        error = "the stream ended without [DONE]"
    out[i] = [t0, t1, max(silent, t1 - last), status, error]
threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts(len(starts)))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("partition") / "mixtral", "mixtral")


def recv_timeout_s(node: Node) -> float:
    """The ``recv_timeout_s`` Attention rank 0 runs with: read from its own command line on ``node``."""
    for pid in node.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "--additional-config" in argv:
            afd = json.loads(argv[argv.index("--additional-config") + 1])["afd"]
            if afd.get("role") == "attention" and afd.get("rank") == 0:
                return parse_options(afd.get("connector_extra_config") or {}).recv_timeout_s
    raise AssertionError(f"no Attention rank 0 process on {node.name}")


def finished(status: dict[str, Any]) -> list[int]:
    """Requests each Attention engine's backend took so far (answered or not), from ``/afd/status``."""
    return [status["requests"][str(rank)]["finished"] for rank in range(2)]


OWN = ("[serve", "[proxy", "afd-mrv2")


def serve_lines(serve: NodeServe) -> str:
    """Serve's own lines (not the roles' logs), the last 6000 characters of them."""
    return "\n".join(line for line in serve.err.lines if line.startswith(OWN))[-6000:]


def timeline(serve: NodeServe, since: float) -> str:
    """Serve's own lines and the engines' failover lines from ``since`` on, each with its arrival (seconds
    after ``since``)."""
    return "\n".join(
        f"  {t - since:+6.1f} s {line[:300]}"
        for t, line in serve.err.timed
        if t >= since and (line.startswith(OWN) or "afd-mrv2 failover" in line)
    )


def stream_through_a_cut(
    node0: Node, node1: Node, second: NodeServe, url: str, model: Path
) -> tuple[list[list[Any]], float, float, float | None]:
    """The stream (STREAM's output), node 1's cable out CUT_AFTER_S into it for CUT_S; the stream's results,
    when the cable went out and back in, and when node 1's serve exited (None: not while it was out)."""
    argv = [sys.executable, "-c", STREAM, url, str(model), json.dumps(STARTS)]
    client = node0.popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert client.stdout is not None
    cut = float(client.stdout.readline()) + CUT_AFTER_S
    time.sleep(max(0.0, cut - time.monotonic()))
    node1.link(False)
    left_at = None
    try:
        while time.monotonic() < cut + CUT_S:
            if left_at is None and second.proc.poll() is not None:
                left_at = time.monotonic()
            time.sleep(0.1)
    finally:
        node1.link(True)
    up = time.monotonic()
    out, err = client.communicate(timeout=600)
    assert client.returncode == 0, err[-2000:]
    return json.loads(out), cut, up, left_at


def test_a_30_s_partition_of_node_1(model: Path) -> None:
    require_namespaces()
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        url = f"http://{node0.addr}:{PORT}"
        first, second = start_two_nodes(cluster, model)
        bound = recv_timeout_s(node0) + 5.0
        warm = time.monotonic()
        assert all(a[0] == 200 for a in answers(node0, url, model, n=8))
        print(f"8 requests before the cut: {time.monotonic() - warm:.1f} s; the bound is {bound:g} s")
        before = finished(afd_status(node0, url))

        stream, cut, up, left_at = stream_through_a_cut(node0, node1, second, url, model)
        lost_at, said_at = first.said(LOST), second.said(r"afd-mrv2 serve: error: node 0 \(.*\) is silent for")
        # node 1 says node 0 is silent once its roles are stopped; its first line after the cut is their stop
        stopping_at = next((t for t, line in second.err.timed if t > cut and line.startswith(OWN)), None)
        # per request: its wall time, the longest it went without a byte, its error (None: answered), its start
        waits = [(t1 - t0, silent, error, t0 - cut) for t0, t1, silent, _, error in stream]
        ok = [w for w in waits if w[2] is None]
        failed = [w for w in waits if w[2] is not None]

        def rel(t: float | None) -> str:
            return "never" if t is None else f"{t - cut:.1f} s"

        def most(got: list[tuple[float, float, str | None, float]], k: int) -> str:
            return f"{max((w[k] for w in got), default=0.0):.1f} s"

        print(
            f"30 s cut: {len(ok)}/{len(waits)} answered (longest wait without a byte {most(ok, 1)}, wall time "
            f"{most(ok, 0)}), {len(failed)} errors (longest wait {most(failed, 1)}, wall time {most(failed, 0)}), "
            f"{sum(1 for w in waits if 0 <= w[3] < CUT_S)} started during the cut; node 0 declared node 1 lost "
            f"{rel(lost_at)} after the cut; node 1 was stopping its roles {rel(stopping_at)} after it, said node 0 is "
            f"silent {rel(said_at)} after it, its serve exited {rel(left_at)} after it"
        )
        for wall, silent, error, start in waits:
            print(f"  started {start:+6.1f} s: wall {wall:5.1f} s, longest wait {silent:5.1f} s, {error or 'answered'}")
        print(f"node 0's serve after the cut:\n{timeline(first, cut)}\nnode 1's:\n{timeline(second, cut)}")
        in_flight = {error is None for wall, _, error, start in waits if start < 0 < start + wall}
        assert in_flight == {True, False}, f"not both engines had a request in flight at the cut: {waits}"
        assert max(w[0] for w in waits) <= bound, f"{waits}\n{serve_lines(first)}"
        assert all("attention 1" in str(error) for _, _, error, _ in failed), f"{failed}\n{serve_lines(first)}"
        took = [a - b for a, b in zip(finished(afd_status(node0, url)), before, strict=True)]
        assert sum(took) == len(STARTS) and len(ok) >= took[0], (took, waits)  # rank 0's requests all answered
        assert lost_at is not None and lost_at < up, serve_lines(first)
        assert said_at is not None and said_at < up, serve_lines(second)
        assert second.proc.wait(STOP_GRACE_S + 10) == 1, serve_lines(second)
        only_init(node1, STOP_GRACE_S + 10)

        time.sleep(1.5)  # node 0 looks at the nodes' beats with the cable back
        status = afd_status(node0, url)
        assert re.fullmatch(r"lost: silent for \d+\.\d s", status["nodes"]["1"]), status
        assert status["live"] == {"attention": [0], "ffn": [0]}, status
        last = finished(status)
        after = answers(node0, url, model, n=8)
        assert all(a[0] == 200 for a in after), [a for a in after if a[0] != 200][:2]
        now = finished(afd_status(node0, url))
        assert (now[0] - last[0], now[1] - last[1]) == (8, 0), (last, now)

        stopped = time.monotonic()
        assert first.stop(timeout=STOP_GRACE_S + 10) == 0, serve_lines(first)
        only_init(node0, STOP_GRACE_S + 10 - (time.monotonic() - stopped))
