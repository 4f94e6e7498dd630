"""A node that never joins: node 0 says which one, in the ready timeout's error, instead of hanging."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.netns import Cluster, require_namespaces

HARNESS = str(Path(__file__).with_name("serve_harness.py"))


def test_a_node_that_never_joins_is_named_when_the_start_times_out() -> None:
    require_namespaces()
    with Cluster(2) as cluster:
        node0 = cluster.nodes[0]
        (node0.tmp / "secret").write_text(os.urandom(16).hex())
        argv = [sys.executable, HARNESS, "/models/fake", "--attention", "2", "--ffn", "2", "--port", "18000"]
        argv += ["--nnodes", "2", "--node-rank", "0", "--master-addr", node0.addr, "--host", node0.addr]
        argv += ["--secret-file", str(node0.tmp / "secret"), "--ready-timeout-s", "2"]
        done = node0.run(argv, timeout=60, env={"FAKE_ROLE": json.dumps({"ffn_own_end": False})})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr
    assert last.startswith("afd-mrv2 serve: error: ffn 1 (node 1 has not joined the store on "), last
    assert "not ready after 2 s" in last, last
    assert "ffn rank 0 (pid" not in last  # node 0's own FFN rank was ready
