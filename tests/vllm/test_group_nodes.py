"""One Attention group over two machines, each role on its own, with vLLM's own multi-node DP flags.

Two hosts made of namespaces (tests/netns.py).  Node 0 runs the FFN rank (``afd-mrv2 ffn``, hosting the
rendezvous store) and the group's front end with DP rank 0 (``python -m vllm.entrypoints.openai.api_server
--data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address NODE0 --data-parallel-rpc-port P``);
node 1 runs DP rank 1 headless (``python -m afd_mrv2.serve.headless ... --data-parallel-start-rank 1``, what
``vllm serve --headless`` runs).  Both DP ranks get the same ``afd`` section and derive their AFD ranks from
vLLM's DP rank; both roles share one AFD_MRV2_SECRET (cross-node pairs are guarded).

* plain vLLM on node 0 (one engine, DP1 TP1) answers 16 greedy completions first;
* the group answers the same 16: identical, max |logprob difference| <= 1e-4;
* the FFN rank served both DP ranks in one loop: items from both, expert calls with rows of both
  (``ranks_per_call["2"]``), and node 1's DP rank reached node 0 over the namespace network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2 import envs
from afd_mrv2.harness.client import compare
from afd_mrv2.harness.servers import BASE_ENV, ENGINE_ARGS, FFN_DONE
from tests.netns import Cluster, Node, require_namespaces
from tests.vllm.harness import make_model
from tests.vllm.test_serve_nodes import answers, greedy_of, peers

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1500)]

PORT, STORE_PORT, RPC_PORT = 18100, 18101, 18102
COMPLETIONS = 16
START_S = 600.0
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


Role = tuple[subprocess.Popen[str], Path]


def _start(node: Node, argv: list[str], env: dict[str, str], log: Path) -> Role:
    """``argv`` inside ``node``, its stdout and stderr into ``log``."""
    with log.open("w") as out:
        proc = node.popen(argv, env={**BASE_ENV, **env}, stdout=out, stderr=subprocess.STDOUT, text=True)
    return proc, log


def _wait_health(node: Node, url: str, procs: list[Role]) -> None:
    deadline = time.monotonic() + START_S
    probe = [sys.executable, "-c", f"import urllib.request; urllib.request.urlopen('{url}/health', timeout=2)"]
    while node.run(probe, timeout=10).returncode != 0:
        if any(proc.poll() is not None for proc, _ in procs) or time.monotonic() > deadline:
            tails = [f"--- {log} (exit {proc.poll()})\n" + "\n".join(log.read_text().splitlines()[-30:])
                     for proc, log in procs]  # fmt: skip
            raise AssertionError(f"not healthy at {url}:\n" + "\n".join(tails))
        time.sleep(2.0)


def _stop(procs: list[Role]) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_dp2_group_with_a_rank_on_each_node_is_token_identical_to_plain_vllm(tmp_path: Path) -> None:
    require_namespaces()
    model = make_model(tmp_path / "model", "mixtral")
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        url = f"http://{node0.addr}:{PORT}"
        server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        server += ["--host", node0.addr, "--port", str(PORT), *ENGINE_ARGS]
        plain = [_start(node0, server, {}, tmp_path / "plain.log")]
        try:
            _wait_health(node0, url, plain)
            reference = greedy_of(answers(node0, url, model, n=COMPLETIONS))
        finally:
            _stop(plain)

        afd: dict[str, Any] = {"connector": "torch_p2p", "num_attention_ranks": 2, "attention_group_size": 2}
        afd |= {"num_ffn_ranks": 1, "host": node0.addr, "port": STORE_PORT}
        secret = {envs.SECRET.name: os.urandom(32).hex()}
        section = json.dumps({"afd": {**afd, "role": "attention"}})
        dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
        dp += ["--data-parallel-address", node0.addr, "--data-parallel-rpc-port", str(RPC_PORT)]
        ffn_cmd = [sys.executable, "-m", "afd_mrv2.cli", "ffn", str(model), "--afd", json.dumps({**afd, "role": "ffn"})]
        headless = [sys.executable, "-m", "afd_mrv2.serve.headless", str(model), *ENGINE_ARGS, *dp]
        headless += ["--data-parallel-start-rank", "1", "--additional-config", section, "--load-format", "afd"]
        front = [*server, *dp, "--api-server-count", "1", "--additional-config", section, "--load-format", "afd"]
        # one core per DP rank (vLLM slices the list by local DP rank); the FFN rank left to the scheduler
        # vLLM's DP group is gloo over the nodes' network: its interface, and each node's own address
        dp_env = [{**secret, "GLOO_SOCKET_IFNAME": "eth0", "VLLM_HOST_IP": node.addr} for node in cluster.nodes]
        roles = [
            _start(node0, [*ffn_cmd, "--", *ENGINE_ARGS], {**secret, CPU_BIND: "nobind"}, tmp_path / "ffn.log"),
            _start(node1, headless, {**dp_env[1], CPU_BIND: "1"}, tmp_path / "dp1-headless.log"),
            _start(node0, front, {**dp_env[0], CPU_BIND: "0"}, tmp_path / "dp0-front.log"),
        ]
        try:
            _wait_health(node0, url, roles)
            got = greedy_of(answers(node0, url, model, n=COMPLETIONS))
            seen = peers(node1)
        finally:
            _stop(roles[:0:-1])  # the Attention side first: the FFN rank then ends its session and reports
            try:
                roles[0][0].wait(60)
            except subprocess.TimeoutExpired:
                _stop(roles[:1])
        ffn_lines = roles[0][1].read_text().splitlines()
        done = [json.loads(line.split(FFN_DONE, 1)[1]) for line in ffn_lines if FFN_DONE in line]
        assert done, "\n".join(ffn_lines[-40:])
        report = done[-1]
        versus = compare(got, reference)
        print(
            f"\n[group over 2 nodes, DP2 1F] vs plain: {json.dumps(versus)}; items per rank "
            f"{report['items_per_attention']}, ranks_per_call {report['ranks_per_call']}; node 1's peers {sorted(seen)}"
        )
        assert versus["identical"] == COMPLETIONS and versus["max_logprob_diff"] <= 1e-4, versus
        items = report["items_per_attention"]
        assert items["0"] == items["1"] > 0, report  # lock-step: both DP ranks, one on each node
        assert report["ranks_per_call"].get("2", 0) > 0, report
        assert node0.addr in seen, seen  # DP rank 1 (node 1) reached the FFN rank and the front end on node 0
