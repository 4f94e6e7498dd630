"""Free topologies on the vLLM path's vLLM-free parts: A Attention processes (RemoteExperts)
and F FFN processes (serve_ffn), threads here, with F not dividing A (3A2F) and F > A
(1A2F, 2A3F).  Experts are sharded over the FFN ranks and held block-local; every FFN rank
serves every Attention rank, and every output equals the unsharded reference."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.mrv2.ffn.report import FfnReport
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.procs import free_port
from afd_mrv2.topology import Topology
from tests.mrv2.test_vllm_path import LAYERS, afd, start_ffn


def _weights(shape: MoeShape, layer: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + layer)
    return torch.randn(shape.num_experts, shape.hidden_size, shape.hidden_size, generator=gen)


def _moe(weights: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        out += w[:, k : k + 1] * torch.einsum("th,thg->tg", x, weights[ids[:, k].long()])
    return out


def _block_experts(shape: MoeShape, layer: int, block: range) -> Any:
    weights = _weights(shape, layer)[block.start : block.stop]

    def run(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert int(ids.min()) >= 0 and int(ids.max()) < len(block), "ids must be block-local"
        return _moe(weights, x, w, ids)

    return run


@pytest.mark.parametrize(
    ("attention", "ffn", "experts"), [(3, 2, 4), (1, 2, 4), (2, 3, 6)], ids=["3A2F", "1A2F", "2A3F"]
)
def test_free_topology_round_trips_match_the_unsharded_reference(
    one_torch_thread: None, attention: int, ffn: int, experts: int
) -> None:
    shape = MoeShape(hidden_size=16, top_k=2, num_experts=experts)
    topology = Topology(attention, ffn, experts)
    port = free_port()
    ranks: dict[str, Any] = {"num_attention_ranks": attention, "num_ffn_ranks": ffn}
    done: dict[str, Any] = {}

    remotes = [
        RemoteExperts(parse_afd_config({**afd("attention", port), **ranks, "rank": a}), max_tokens=16)
        for a in range(attention)
    ]
    for remote in remotes:
        for layer in LAYERS:
            remote.add_layer(layer, shape)
    forwards = (5, 16, 1)

    def run(a: int) -> None:
        gen = torch.Generator().manual_seed(10 + a)
        try:
            for tokens in forwards:
                for ordinal, layer in enumerate(LAYERS):
                    x = torch.randn(tokens, shape.hidden_size, generator=gen)
                    w = torch.rand(tokens, shape.top_k, generator=gen)
                    ids = torch.randint(0, experts, (tokens, shape.top_k), generator=gen, dtype=torch.int32)
                    expected = _moe(_weights(shape, ordinal), x, w, ids)
                    torch.testing.assert_close(remotes[a].exchange(layer, x, w, ids), expected, rtol=1e-5, atol=1e-5)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread
            done[f"attention-error{a}"] = exc

    servers = [
        start_ffn(
            done,
            {**afd("ffn", port), **ranks, "rank": f},
            [_block_experts(shape, layer, topology.experts_of(f)) for layer in range(len(LAYERS))],
            key=f,
            shape=shape,
            max_tokens=16,
            index=f,
            local_experts_only=True,
        )
        for f in range(ffn)
    ]
    clients = [threading.Thread(target=run, args=(a,), daemon=True) for a in range(attention)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(120)
    assert not any(t.is_alive() for t in clients) and not any("error" in k for k in done), done
    for remote in remotes:
        remote.close()
    for thread in servers:
        thread.join(60)
    assert not any(t.is_alive() for t in servers) and not any("error" in k for k in done), done
    assert [remote.calls for remote in remotes] == [len(LAYERS) * len(forwards)] * attention
    for f in range(ffn):
        report: FfnReport = done[f"report{f}"]
        # every FFN rank served every Attention rank's every MoE call, and computed some of them
        assert dict(report.items_per_attention) == {a: len(LAYERS) * len(forwards) for a in range(attention)}
        assert report.computed > 0 and set(report.ends) == set(range(attention)), report.as_dict()
