"""``afd-mrv2 serve`` with fake roles over the nodes of a :class:`tests.netns.Cluster`.

:class:`NodeServe` starts serve (``serve_harness.py``) on one node and collects its stdout and stderr lines with
their arrival times; :func:`send_completions` and :func:`afd_status` ask node 0's endpoint from inside node 0.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.netns import Cluster, Node
from tests.serve.conftest import read_lines

HARNESS = str(Path(__file__).with_name("serve_harness.py"))
READY = "afd-mrv2 serve: ready at"
#: every node's serve listens here: each Cluster is a network of its own
PORT = 18000
#: serve's default --stop-grace-s
STOP_GRACE_S = 5.0
SECRET_FILE = "afd-secret"

# A client run inside a node: N concurrent POSTs to URL/v1/completions (or one GET of URL/afd/status with
# N = 0); prints one JSON list of {"status", "body", "elapsed"}; a transport error is status -1.
_CLIENT = r"""
import json, sys, threading, time, urllib.error, urllib.request
url, n, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
results = [None] * max(n, 1)
def one(i):
    t0 = time.monotonic()
    if n:
        body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    else:
        req = urllib.request.Request(url + "/afd/status")
    try:
        with opener.open(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    except Exception as exc:
        status, text = -1, repr(exc)
    results[i] = {"status": status, "body": text, "elapsed": time.monotonic() - t0}
threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


def serve_args(cluster: Cluster, node_rank: int, *extra: str) -> list[str]:
    """2 Attention engines and 2 FFN ranks over the cluster's 2 nodes (rank r on node r), endpoint on node 0,
    the secret :func:`give_secret` gave."""
    master = cluster.nodes[0].addr
    return [
        "/models/fake",
        "--attention",
        "2",
        "--attention-groups",
        "2",
        "--ffn",
        "2",
        "--port",
        str(PORT),
        "--nnodes",
        str(cluster.n),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        master,
        "--host",
        master,
        "--ready-timeout-s",
        "30",
        "--secret-file",
        str(cluster.nodes[node_rank].tmp / SECRET_FILE),
        *extra,
    ]


def give_secret(cluster: Cluster) -> None:
    """The deployment's secret: the same file on every node (in its TMPDIR), as ``--secret-file`` wants it."""
    secret = secrets.token_hex(32)
    for node in cluster.nodes:
        (node.tmp / SECRET_FILE).write_text(secret + "\n")


class NodeServe:
    """One serve on one node: its host-side client, its stdout/stderr lines (arrival time, text)."""

    def __init__(self, node: Node, args: Sequence[str], behaviour: dict[str, object] | None = None) -> None:
        self.node = node
        env = {"FAKE_ROLE": json.dumps({"ffn_own_end": False, **(behaviour or {})}), "PYTHONUNBUFFERED": "1"}
        self.proc = node.popen(
            [sys.executable, HARNESS, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out, self.err, self._threads = read_lines(self.proc)

    def err_lines(self) -> list[str]:
        return [line for _, line in self.err]

    def tail(self, n: int = 15) -> str:
        return f"{self.node.name}'s serve (rc {self.proc.poll()}), last stderr lines:\n" + "\n".join(
            self.err_lines()[-n:]
        )

    def wait_for(self, match: str | re.Pattern[str], timeout: float, *, stdout: bool = False) -> tuple[float, str]:
        """The first line (stderr, or stdout) containing ``match`` (a pattern: matching it whole), and when it
        came; AssertionError after ``timeout``, or once serve ended without it."""
        test = match.fullmatch if isinstance(match, re.Pattern) else lambda line: match in line
        lines = self.out if stdout else self.err
        deadline = time.monotonic() + timeout
        while True:
            found = next(((at, line) for at, line in list(lines) if test(line)), None)
            if found is not None:
                return found
            ended = self.proc.poll() is not None and not any(t.is_alive() for t in self._threads)
            if ended or time.monotonic() > deadline:
                when = "before serve ended" if ended else f"within {timeout:g} s"
                shown = match.pattern if isinstance(match, re.Pattern) else match
                raise AssertionError(f"no line {shown!r} {when}; {self.tail()}")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 40.0) -> tuple[float, str]:
        """When serve printed its ready line, and the endpoint's base URL (without ``/v1``)."""
        at, line = self.wait_for(re.compile(re.escape(READY) + r" \S+"), timeout, stdout=True)
        return at, line.split()[-1].removesuffix("/v1")

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g} s; {self.tail()}") from None
        for t in self._threads:
            t.join(5)
        return rc

    def host_pid(self) -> int:
        """The host pid of the serve process itself (not its client, not a role): found by its command line."""
        for pid in self.node.pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if HARNESS.encode() in argv:
                return pid
        raise AssertionError(f"no serve process among {self.node.name}'s processes {self.node.pids()}")


def run_client(node: Node, url: str, n: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """Run the client inside ``node`` to its end (see ``_CLIENT``)."""
    done = node.run([sys.executable, "-c", _CLIENT, url, str(n), str(timeout)], timeout=timeout + 15)
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def start_client(node: Node, url: str, n: int, timeout: float = 30.0) -> subprocess.Popen[str]:
    """Start the client inside ``node``; read its result with :func:`client_result`."""
    argv = [sys.executable, "-c", _CLIENT, url, str(n), str(timeout)]
    return node.popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def client_result(client: subprocess.Popen[str], timeout: float) -> list[dict[str, Any]]:
    try:
        out, err = client.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        client.kill()
        client.communicate()
        raise AssertionError(f"a request got neither an answer nor an error within {timeout:g} s") from None
    assert client.returncode == 0, err
    results: list[dict[str, Any]] = json.loads(out)
    return results


def send_completions(node: Node, url: str, n: int) -> list[dict[str, Any]]:
    """``n`` concurrent completions from inside ``node``: each {"status", "body", "elapsed", "rank"}."""
    results = run_client(node, url, n)
    for result in results:
        result["rank"] = json.loads(result["body"]).get("rank") if result["status"] == 200 else None
    return results


def afd_status(node: Node, url: str) -> dict[str, Any]:
    """``GET /afd/status`` of the endpoint, from inside ``node``."""
    (result,) = run_client(node, url, 0)
    assert result["status"] == 200, result
    status: dict[str, Any] = json.loads(result["body"])
    return status


def only_init(node: Node, within: float) -> float:
    """Wait until the node runs nothing but its init; how long that took (AssertionError after ``within``)."""
    t0 = time.monotonic()
    while set(node.pids()) - {node.init_pid}:
        if time.monotonic() - t0 > within:
            left = {pid: _cmdline(pid) for pid in set(node.pids()) - {node.init_pid}}
            raise AssertionError(f"{node.name} still runs {left} after {within:g} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
