"""An Attention engine that dies ends only the FFN loop serving it (the vLLM path's scoped link): the FFN
rank goes on serving the other engine, whose answers stay exact, and its session ends when that one left;
on each pair transport (``afd.transport``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.mrv2.ffn.report import FfnReport
from afd_mrv2.mrv2.ffn.server import LEFT_BETWEEN_STEPS
from afd_mrv2.procs import free_port
from tests.mrv2.test_vllm_path import LAYERS, SHAPE, afd, pair_transport, start_ffn
from tests.mrv2.test_vllm_path import checked_forward as forward

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = {"num_attention_ranks": 2, "num_ffn_ranks": 1}

#: Attention rank 1 as its own process: one forward of both MoE layers, then it waits to be killed.
ENGINE_1 = """
import sys, time, torch
from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from tests.mrv2.test_vllm_path import LAYERS, SHAPE, afd
section = {**afd("attention", int(sys.argv[1]), transport=sys.argv[3]), **eval(sys.argv[2]), "rank": 1}
remote = RemoteExperts(parse_afd_config(section), max_tokens=32)
for layer in LAYERS:
    remote.add_layer(layer, SHAPE)
for layer in LAYERS:
    remote.exchange(layer, torch.randn(3, SHAPE.hidden_size), torch.rand(3, SHAPE.top_k),
                    torch.randint(0, SHAPE.num_experts, (3, SHAPE.top_k), dtype=torch.int32))
print("served", flush=True)
time.sleep(600)
"""


def test_a_dead_engine_ends_only_its_loop_and_the_ffn_rank_serves_the_other_on(
    one_torch_thread: None, transport: str
) -> None:
    port = free_port()
    done: dict[str, Any] = {}
    ffn = start_ffn(done, {**afd("ffn", port, transport=transport), **TOPOLOGY, "rank": 0})
    engine_1 = subprocess.Popen(
        [sys.executable, "-c", ENGINE_1, str(port), repr(TOPOLOGY), transport],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    section = {**afd("attention", port, transport=transport), **TOPOLOGY, "rank": 0}
    remote = RemoteExperts(parse_afd_config(section), max_tokens=32)
    for layer in LAYERS:
        remote.add_layer(layer, SHAPE)
    gen = torch.Generator().manual_seed(0)
    try:
        forward(remote, gen, 5)
        assert engine_1.stdout is not None and engine_1.stdout.readline().strip() == "served"
        assert [pair_transport(port, pair) for pair in ("a0.1-f0.1", "a1.1-f0.1")] == [transport] * 2
        os.killpg(engine_1.pid, signal.SIGKILL)  # attention rank 1 dies, as a killed vLLM engine does
        engine_1.wait(10)
        time.sleep(1.0)  # the FFN rank has seen the connection close by now
        for tokens in (7, 1, 32):  # attention rank 0 goes on: every answer exact
            forward(remote, gen, tokens)
        assert ffn.is_alive(), done  # the session lives while an engine is left
    finally:
        remote.close()
        if engine_1.poll() is None:
            os.killpg(engine_1.pid, signal.SIGKILL)
    ffn.join(30)
    assert not ffn.is_alive() and "error" not in done, done
    report: FfnReport = done["report"]
    assert dict(report.items_per_attention) == {0: 4 * len(LAYERS), 1: len(LAYERS)}
    assert set(report.ends) == {0, 1}
    # killed between two steps: nothing of a step was lost; rank 0 closed its session at the end
    assert report.ends[1].startswith(f"{LEFT_BETWEEN_STEPS}: attention rank 1 closed its connection"), report.ends
    assert "the attention rank closed its AFD session" in report.ends[0], report.ends
