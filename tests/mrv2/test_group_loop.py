"""An Attention group (one vLLM deployment's DP ranks, in lock-step) on the vLLM path's vLLM-free parts: the ranks
are RemoteExperts on threads here, the FFN ranks serve_ffn on threads (or a killed process).  Each FFN rank serves
the whole group on ONE loop: one expert computation per MoE layer and step over the rows of every rank of the group
(M:N), each rank's rows sent back to it; a rank's dummy forward (all padding) sends 0 rows and counts as no
contributor; with expert replicas an FFN rank killed mid-item costs no rank an answer, though each rank re-sends its
own share, interleaved with the group's next items."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.mrv2.attention.rows import RowShare
from afd_mrv2.mrv2.ffn.report import FfnReport
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.procs import free_port
from afd_mrv2.topology import Topology
from tests.mrv2.test_ffn_failover import _end, _held_experts, _spawn_ffn
from tests.mrv2.test_free_topologies import _moe, _weights
from tests.mrv2.test_vllm_path import LAYERS, afd, start_ffn

HIDDEN, TOP_K, EXPERTS = 16, 2, 4
SHAPE = MoeShape(HIDDEN, TOP_K, EXPERTS)


class Padding:
    """A rank's forward-context stand-in: how many of the next call's rows are real (the rest is padding)."""

    def __init__(self) -> None:
        self.real: int | None = None
        self.rows = 0

    def mask(self) -> torch.Tensor | None:
        if self.real is None:
            return None
        mask = torch.zeros(self.rows, dtype=torch.bool)
        mask[self.real :] = True
        return mask


def _group(port: int, ranks: dict[str, Any], transport: str) -> list[tuple[RemoteExperts, Padding]]:
    """The group's two ranks: the same section (its first rank), each process's own rank as vLLM's DP rank gives it."""
    out = []
    for a in range(2):
        padding = Padding()
        config = parse_afd_config({**afd("attention", port, transport=transport), **ranks, "rank": 0})
        config = dataclasses.replace(config, rank=a)  # what admit derives from the process's DP rank
        remote = RemoteExperts(config, max_tokens=16, share=RowShare(padding=padding.mask))
        for layer in LAYERS:
            remote.add_layer(layer, SHAPE)
        out.append((remote, padding))
    return out


def _forwards(
    remote: RemoteExperts, padding: Padding, plan: list[int], seed: int, errors: list[Any]
) -> Callable[[], None]:
    """One rank's forwards: ``plan`` its real tokens per step (0: a dummy forward of one padded row), each MoE
    output checked against the unsharded reference (padding rows: zeros)."""

    def run() -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for real in plan:
                rows = max(real, 1)
                padding.real, padding.rows = real, rows
                for ordinal, layer in enumerate(LAYERS):
                    x, w = torch.randn(rows, HIDDEN, generator=gen), torch.rand(rows, TOP_K, generator=gen)
                    ids = torch.randint(0, EXPERTS, (rows, TOP_K), generator=gen, dtype=torch.int32)
                    out = remote.exchange(layer, x, w, ids)
                    want = _moe(_weights(SHAPE, ordinal), x, w, ids)
                    want[real:] = 0
                    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    return run


def _run_group(group: list[tuple[RemoteExperts, Padding]], plans: list[list[int]]) -> list[Any]:
    errors: list[Any] = []
    threads = [
        threading.Thread(target=_forwards(remote, padding, plan, 11 + i, errors), daemon=True)
        for i, ((remote, padding), plan) in enumerate(zip(group, plans, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a rank of the group hung"
    return errors


def test_a_group_s_ranks_meet_in_one_expert_computation_per_layer_and_step(one_torch_thread: None) -> None:
    port = free_port()
    ranks = {"num_attention_ranks": 2, "attention_group_size": 2, "num_ffn_ranks": 1}
    done: dict[str, Any] = {}
    full = [_held_experts(SHAPE, layer, tuple(range(EXPERTS))) for layer in range(len(LAYERS))]
    ffn = start_ffn(done, {**afd("ffn", port), **ranks, "rank": 0}, full, shape=SHAPE, max_tokens=16)
    group = _group(port, ranks, "gloo")
    # step by step (lock-step: every rank calls every layer each step): both real, one idle (dummy), both real
    plans = [[5, 3, 0, 7], [4, 0, 6, 2]]
    try:
        errors = _run_group(group, plans)
    finally:
        for remote, _ in group:
            remote.close()
    ffn.join(30)
    assert errors == [] and not any(k.startswith("error") for k in done), (errors, done)
    report: FfnReport = done["report"]
    steps, layers = len(plans[0]), len(LAYERS)
    assert report.computed == steps * layers  # one computation per layer and step for the whole group
    assert dict(report.ranks_per_call) == {2: 2 * layers, 1: 2 * layers}
    assert report.tokens_per_item == {9: 2 * layers, 3: layers, 6: layers}  # 5+4, 3+0, 0+6, 7+2 rows
    assert report.items_per_attention == {0: steps * layers, 1: steps * layers}
    assert [remote.tokens for remote, _ in group] == [{5: 2, 3: 2, 0: 2, 7: 2}, {4: 2, 0: 2, 6: 2, 2: 2}]


def test_with_replicas_an_ffn_rank_killed_mid_item_costs_no_rank_of_the_group_an_answer(
    one_torch_thread: None, transport: str
) -> None:
    """2A (one group) 2F R = 2, FFN rank 1 a process killed on its 3rd computation: both ranks re-send their
    share of the item in flight to FFN rank 0, whose one loop serves each re-send alone, then the group on."""
    port = free_port()
    ranks = {"num_attention_ranks": 2, "attention_group_size": 2, "num_ffn_ranks": 2, "expert_replicas": 2}
    done: dict[str, Any] = {}
    held = Topology(2, 2, EXPERTS, 2).held_by(0)
    survivor = start_ffn(
        done,
        {**afd("ffn", port, transport=transport), **ranks, "rank": 0},
        [_held_experts(SHAPE, layer, held) for layer in range(len(LAYERS))],
        shape=SHAPE,
        max_tokens=16,
        index=0,
        local_experts_only=True,
    )
    victim = _spawn_ffn({**afd("ffn", port, transport=transport), **ranks, "rank": 1}, EXPERTS, 3)
    group = _group(port, ranks, transport)
    plans = [[16, 9, 16, 5, 1, 12], [7, 16, 0, 16, 3, 16]]
    errors: list[Any] = []
    client = threading.Thread(target=lambda: errors.extend(_run_group(group, plans)), daemon=True)
    try:
        client.start()
        assert victim.stdout is not None and victim.stdout.readline().strip() == "computing"
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
        client.join(90)
        assert not client.is_alive(), "the group hung after the kill"
    finally:
        for remote, _ in group:
            remote.close()
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
        _end(victim)
    survivor.join(60)
    assert errors == [], errors
    logs = [remote.stats()["failover"] for remote, _ in group]
    assert all(log is not None and log["failovers"] == 1 and list(log["lost"]) == ["1"] for log in logs), logs
    report: FfnReport = done["report"]
    assert report.redispatched == sum(log["resent_items"] for log in logs) >= 1, (report.as_dict(), logs)
    assert report.ranks_per_call[2] >= 1 and report.ranks_per_call[1] >= report.redispatched
