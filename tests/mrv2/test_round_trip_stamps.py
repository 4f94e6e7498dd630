"""The vLLM path's ``round_trip_stamps`` (docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.stamps"):
``RemoteExperts.stats()`` carries the round-trip Attention side's stamps, one item per call, on either
pair transport, and keeps them once the session closed; the FFN role's report carries its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.hooks.p2p.stamps import ATTENTION_POINTS, SPANS, breakdown
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.mrv2.ffn.report import FfnReport
from afd_mrv2.procs import free_port
from tests.mrv2.test_vllm_path import LAYERS, SHAPE, afd, start_ffn


def test_the_attention_stats_carry_the_round_trip_stamps(one_torch_thread: None, transport: str) -> None:
    port = free_port()
    done: dict[str, Any] = {}
    thread = start_ffn(done, afd("ffn", port, transport=transport))
    remote = RemoteExperts(parse_afd_config(afd("attention", port, transport=transport)), max_tokens=32)
    for layer in LAYERS:
        remote.add_layer(layer, SHAPE)
    gen = torch.Generator().manual_seed(0)
    try:
        assert remote.stats()["round_trip_stamps"] is None  # no session yet
        for tokens in (4, 16):
            for layer in LAYERS:
                x = torch.randn(tokens, SHAPE.hidden_size, generator=gen)
                weights = torch.rand(tokens, SHAPE.top_k, generator=gen)
                ids = torch.randint(0, SHAPE.num_experts, (tokens, SHAPE.top_k), generator=gen, dtype=torch.int32)
                remote.exchange(layer, x, weights, ids)
        live = remote.stats()["round_trip_stamps"]
    finally:
        remote.close()
    thread.join(30)
    assert not thread.is_alive() and "error" not in done, done
    assert live["items"] == remote.calls == 4
    means = live["means_ns"]
    assert list(means) == list(ATTENTION_POINTS)
    chain = [means[p] for p in ("entered", "packed", "first_send", "combine_done", "waited", "unpacked")]
    assert chain == sorted(chain) and means["sends_done"] >= means["first_send"], means
    spans = breakdown(live, None)
    assert spans["round trip"] > 0 and spans["wire out"] is None  # no FFN side given: nothing joined
    report: FfnReport = done["report"]
    ffn = report.as_dict()["round_trip_stamps"]["0"]
    assert ffn["items"] == 4, ffn  # every item it served, its combine sent
    joined = breakdown(live, ffn)  # one process, one clock
    assert joined["sum"] == pytest.approx(joined["round trip"]), joined
    assert all(joined[name] >= 0 for name, _, _ in SPANS), joined
    assert remote.stats()["round_trip_stamps"] == live  # the closed session's, kept


def test_the_ffn_report_keeps_each_attention_ranks_last_loop_stamps() -> None:
    report = FfnReport(moe_layers=2)
    assert report.as_dict()["round_trip_stamps"] == {}
    first, restarted = {"items": 4, "means_ns": {"payload_done": 7}}, {"items": 2, "means_ns": {"payload_done": 9}}
    report.loop_stamps(1, first)
    report.loop_stamps(0, first)
    report.loop_stamps(1, restarted)  # a restarted engine's loop: its Attention side counts afresh too
    assert report.as_dict()["round_trip_stamps"] == {"0": first, "1": restarted}
