"""The doubles keep the operator contracts they claim to mimic (docstrings of afd_mrv2.testing)."""

from __future__ import annotations

import threading

import pytest
import torch

from afd_mrv2.hooks.cam.evidence import StreamBehaviour
from afd_mrv2.testing.cam_fabric import DelayEveryOther, Fabric, FabricAborted, ForeignWorker
from afd_mrv2.testing.camasync_doubles import CamAsyncDoubles, quantize, route
from afd_mrv2.testing.camp2p_doubles import CamP2PDoubles
from afd_mrv2.testing.probe_doubles import probe_camasync, probe_camp2p

H, K, E = 4, 2, 4
COMMON = dict(
    comm_id=0, hidden_size=H, topk=K, ffn_size=2, attn_size=1, expert_per_rank=E // 2, world_size=3, group_name="g"
)


def test_fabric_delays_keep_fifo_within_a_domain_and_count_overtakes() -> None:
    fabric = Fabric(delay=lambda m: 0.05 if m.tag == ("slow",) else 0.0, timeout_s=2)
    fabric.post(channel="c", src=0, dst=1, tag=("slow",), payload={"i": 0}, fifo="a")
    fabric.post(channel="c", src=0, dst=1, tag=("fast",), payload={"i": 1}, fifo="a")  # same domain: stays behind
    fabric.post(channel="c", src=0, dst=1, tag=("fast",), payload={"i": 2}, fifo="b")  # other domain: overtakes
    taken = [fabric.take(channel="c", dst=1).payload["i"] for _ in range(3)]
    assert taken == [2, 0, 1]
    assert (fabric.overtakes, fabric.late_deliveries, fabric.pending()) == (1, 0, 0)
    # a receiver bound to the slow channel sees the other channel's later message complete first
    fabric.post(channel="c", src=0, dst=1, tag=("slow",), payload={"i": 3}, fifo="a")
    fabric.post(channel="d", src=0, dst=1, tag=("fast",), payload={"i": 4}, fifo="b")
    assert fabric.take(channel="c", dst=1).payload["i"] == 3
    assert fabric.late_deliveries == 1


def test_fabric_timeout_and_abort() -> None:
    fabric = Fabric(timeout_s=0.05)
    with pytest.raises(TimeoutError, match="nothing for rank 3"):
        fabric.take(channel="c", dst=3)
    fabric = Fabric(timeout_s=5)
    threading.Timer(0.05, fabric.abort).start()
    with pytest.raises(FabricAborted):
        fabric.take(channel="c", dst=3)


def test_delay_every_other_targets_the_second_transfer_of_a_layer() -> None:
    delay = DelayEveryOther("dispatch", 0.5)
    fabric = Fabric(delay=delay)
    for i in range(2):
        fabric.post(channel=("dispatch", "g", 0), src=0, dst=1, tag=(3,), payload={}, fifo=i)
    fabric.post(channel=("combine", "g", 0), src=0, dst=1, tag=(3,), payload={}, fifo=2)
    visible = sorted(fabric._messages, key=lambda m: m.seq)
    assert visible[1].visible_at - visible[0].visible_at > 0.4 and visible[2].visible_at < visible[1].visible_at


def test_foreign_worker_runs_late_and_reports_failures() -> None:
    worker = ForeignWorker("w", lag_s=0.01)
    done: list[int] = []
    worker.submit(lambda: done.append(1))
    assert done == []  # returned before the effect ran
    worker.drain()
    assert done == [1]
    worker.submit(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="operator failed on its own stream"):
        worker.drain()
    worker.close()


def test_camasync_dispatch_groups_rows_by_local_expert_and_combine_pairs() -> None:
    d = CamAsyncDoubles(Fabric(timeout_s=2))
    x = torch.arange(3 * H, dtype=torch.float32).reshape(3, H)
    ids = torch.tensor([[3, 0], [1, 3], [0, 2]])  # FFN 0 owns experts 0,1; FFN 1 owns 2,3
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]])
    d.async_dispatch_send(
        x, ids, None, max_seq_len=8, batch_size=3, rank=0, layer_idx=5, tp_size=1, dynamic_quant=0, **COMMON
    )
    outs = {}
    for f in (1, 2):
        out = d.async_dispatch_recv(x[:1], None, batch_size=8, rank=f, tp_size=1, dynamic_quant=0, **COMMON)
        n = int(out[5].sum())
        assert out[4].tolist() == [3, 0, 5]
        outs[f] = out
        expected = {1: x[[0, 2, 1]], 2: x[[2, 0, 1]]}[f]  # by local expert, token order within an expert
        assert torch.equal(out[0][:n], expected)
        assert int(out[6][0]) == (3 if f == 1 else 0)  # shared input goes to FFN (source % F) = 0
    for f in (1, 2):
        n = int(outs[f][5].sum())
        d.async_combine_send(
            outs[f][0][:n] * 10,
            outs[f][1][: int(outs[f][6][0])] if f == 1 else outs[f][0][:n] * 10,
            None,
            outs[f][4],
            batch_size=8,
            rank=f,
            tp_size=1,
            **COMMON,
        )
    with pytest.raises(RuntimeError, match="do not pair with the oldest outstanding dispatch"):
        d.async_combine_recv(x[:1], ids[:2], weights[:2], None, batch_size=2, rank=0, **COMMON)
    combined = d.async_combine_recv(x[:1], ids, weights, None, batch_size=3, rank=0, **COMMON)
    expected = 10 * (weights.sum(1, keepdim=True) * x) + x
    assert torch.allclose(combined, expected)


def test_camasync_combine_send_needs_a_real_routed_row() -> None:
    d = CamAsyncDoubles(Fabric(timeout_s=2))
    header = torch.tensor([1, 0, 0])
    with pytest.raises(RuntimeError, match="non-empty"):
        d.async_combine_send(
            torch.empty(0, H), torch.empty(0, H), None, header, batch_size=1, rank=1, tp_size=1, **COMMON
        )
    with pytest.raises(RuntimeError, match="int8"):
        d.async_combine_send(
            torch.zeros(1, H, dtype=torch.int8),
            torch.empty(0, H),
            None,
            header,
            batch_size=1,
            rank=1,
            tp_size=1,
            **COMMON,
        )


def test_quantize_and_route_helpers() -> None:
    x = torch.randn(5, H)
    q, s = quantize(x)
    assert q.dtype == torch.int8 and torch.allclose(q.float() * s[:, None], x, atol=x.abs().max().item() / 127)
    positions, local = route(torch.tensor([[1, 0], [0, 1]]), 0, 2)
    assert positions.tolist() == [1, 2, 0, 3] and local.tolist() == [0, 0, 1, 1]


def test_camp2p_ffn_gathers_its_attention_ranks_in_order() -> None:
    d = CamP2PDoubles(Fabric(timeout_s=2))
    sizes = dict(
        hidden_size=H, topk=K, expert_rank_size=1, attention_rank_size=2, group_ep="afd0", aiv_num=8, compute_gate=0
    )
    a1, a0 = torch.ones(2, H), torch.zeros(3, H)
    d.a2e(a1, None, None, batch_size=2, rank=2, **sizes)
    d.a2e(a0, None, None, batch_size=3, rank=1, **sizes)
    expand_x, _, _, counts, mask = d.a2e(torch.empty(0, H), None, None, batch_size=6, rank=0, **sizes)
    assert counts.tolist() == [3, 2] and mask.tolist() == [True] * 5 + [False]
    assert torch.equal(expand_x[:5], torch.cat([a0, a1])) and expand_x[5].abs().sum() == 0
    with pytest.raises(RuntimeError, match="rows received for batch_size"):
        d.a2e(a0, None, None, batch_size=3, rank=1, **sizes)
        d.a2e(a1, None, None, batch_size=2, rank=2, **sizes)
        d.a2e(torch.empty(0, H), None, None, batch_size=4, rank=0, **sizes)


@pytest.mark.parametrize("foreign", [(), ("a2e",), ("e2a",), ("a2e", "e2a")])
def test_probe_classifies_camp2p_doubles(foreign: tuple[str, ...]) -> None:
    evidence = probe_camp2p(CamP2PDoubles(Fabric(timeout_s=5), foreign=foreign))
    assert {q.split(".")[1] for q, e in evidence.operators.items() if e.stream is StreamBehaviour.FOREIGN} == set(
        foreign
    )


@pytest.mark.parametrize(
    "foreign", [(), ("async_dispatch_recv",), ("async_dispatch_send", "async_combine_send"), CamAsyncDoubles.OPS]
)
def test_probe_classifies_camasync_doubles(foreign: tuple[str, ...]) -> None:
    evidence = probe_camasync(CamAsyncDoubles(Fabric(timeout_s=5), foreign=foreign))
    assert {q.split(".")[1] for q, e in evidence.operators.items() if e.stream is StreamBehaviour.FOREIGN} == set(
        foreign
    )
    assert all(e.present for e in evidence.operators.values()) and len(evidence.operators) == 4
