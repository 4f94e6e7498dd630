"""The CPU doubles keep the contract of the real operators they stand in for.

The contract is the one written down for the real operators (argument order and
outputs in ``afd_mrv2/hooks/cam/camasync.py`` / ``camp2p.py``, the mimicked
behaviour in the docstrings of ``tests/support/*_doubles.py``, and the
afd-plugin facts in shared/FACTS.md): shapes and dtypes, routing grouped by local
expert in token order, the shared-expert rank ``source % F``, the one-row
zero-token placeholder, per-row int8 quantization, FIFO per (source,
destination, layer) with overtaking across layers, combine pairing with the
oldest outstanding dispatch, the FFN-first / attention-first world ranks.  Every
expected value is computed here from that text with plain loops, never by
calling a double (or its helpers) a second time.
"""

from __future__ import annotations

import threading

import pytest
import torch

from afd_mrv2.hooks.cam.evidence import StreamBehaviour
from tests.support.cam_fabric import DelayEveryOther, Fabric, FabricAborted, ForeignWorker, Message
from tests.support.camasync_doubles import CamAsyncDoubles, quantize, route_rows
from tests.support.camp2p_doubles import CamP2PDoubles
from tests.support.probe_doubles import probe_camasync, probe_camp2p

H, K = 4, 2
A, F, E_R = 2, 2, 2  # CAMAsync: attention world ranks 0..A-1, FFN A..A+F-1, E_R experts per FFN rank
CAPACITY = 8  # batch_size an FFN rank passes to async_dispatch_recv


# --------------------------------------------------------------------------- the fabric and the worker


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


# --------------------------------------------------------------------------- CAMAsync, called as the connector does


def dispatch_send(d: CamAsyncDoubles, x: torch.Tensor, ids: torch.Tensor, rank: int, layer: int, quant: int = 0):
    # x, topk_ids, comm_args, comm_id, max_seq_len, batch_size, hidden_size, topk, ffn_size, attn_size,
    # expert_per_rank, rank, world_size, layer_idx, tp_size, dynamic_quant, group_name
    d.async_dispatch_send(x, ids, None, 0, 16, x.shape[0], H, K, F, A, E_R, rank, A + F, layer, 1, quant, "g")


def dispatch_recv(d: CamAsyncDoubles, ffn: int, quant: int = 0, dtype: torch.dtype = torch.float32):
    # placeholder, comm_args, comm_id, batch_size, hidden_size, topk, ffn_size, attn_size, expert_per_rank,
    # rank, world_size, tp_size, dynamic_quant, group_name
    placeholder = torch.zeros(1, H, dtype=dtype)
    return d.async_dispatch_recv(placeholder, None, 0, CAPACITY, H, K, F, A, E_R, A + ffn, A + F, 1, quant, "g")


def combine_send(d: CamAsyncDoubles, routed: torch.Tensor, shared: torch.Tensor, header: torch.Tensor, ffn: int):
    # routed_out, shared_out, comm_args, token_nums_rankid_layeridx, comm_id, batch_size, hidden_size, topk,
    # ffn_size, attn_size, expert_per_rank, rank, world_size, tp_size, group_name
    d.async_combine_send(routed, shared, None, header, 0, CAPACITY, H, K, F, A, E_R, A + ffn, A + F, 1, "g")


def combine_recv(d: CamAsyncDoubles, ids: torch.Tensor, weights: torch.Tensor, rank: int) -> torch.Tensor:
    # placeholder, topk_ids, topk_weights, comm_args, comm_id, batch_size, hidden_size, topk, ffn_size,
    # attn_size, expert_per_rank, rank, world_size, group_name
    placeholder = torch.zeros(1, H)
    return d.async_combine_recv(placeholder, ids, weights, None, 0, ids.shape[0], H, K, F, A, E_R, rank, A + F, "g")


def expected_rows(x: torch.Tensor, ids: torch.Tensor, ffn: int) -> tuple[list[torch.Tensor], list[int]]:
    """The (token, k) rows routed to FFN rank ``ffn``, grouped by local expert, token order within an expert."""
    rows, counts = [], []
    for local in range(E_R):
        expert = ffn * E_R + local
        picked = [x[t] for t in range(ids.shape[0]) for k in range(ids.shape[1]) if int(ids[t, k]) == expert]
        rows += picked
        counts.append(len(picked))
    return rows, counts


def ffn_compute(out: tuple[torch.Tensor, ...], ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e`` multiplies by ``e + 1`` (global id), the shared expert by 3; a zero-row receive -> one placeholder row."""
    expand_x, shared, counts, shared_rows = out[0], out[1], out[5].tolist(), int(out[6][0])
    factors = [ffn * E_R + local + 1 for local, n in enumerate(counts) for _ in range(n)]
    routed = expand_x[: len(factors)] * torch.tensor(factors, dtype=expand_x.dtype).reshape(-1, 1)
    if not factors:
        routed = torch.full((1, H), 1e6)  # the placeholder must not reach any output
    return routed, shared[:shared_rows] * 3


def expected_combine(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * expert(ids[t, k])(x[t]) + shared(x[t]), per token."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            out[t] += float(weights[t, k]) * (int(ids[t, k]) + 1) * x[t]
        out[t] += 3 * x[t]
    return out


def test_camasync_dispatch_groups_rows_by_local_expert_and_combine_pairs() -> None:
    d = CamAsyncDoubles(Fabric(timeout_s=2))
    g = torch.Generator().manual_seed(0)
    # experts 0,1 on FFN 0 (world 2), experts 2,3 on FFN 1 (world 3); attention 1 routes nothing to FFN 1
    sources = {
        0: (torch.randn(3, H, generator=g), torch.tensor([[3, 0], [1, 3], [0, 2]])),
        1: (torch.randn(2, H, generator=g), torch.tensor([[1, 0], [0, 1]])),
    }
    weights = {s: torch.rand(ids.shape, generator=g) for s, (_, ids) in sources.items()}
    for s, (x, ids) in sources.items():
        dispatch_send(d, x, ids, rank=s, layer=5)
    received = {}
    for f in range(F):
        for _ in sources:  # the next arrival from any source; the header names it
            out = dispatch_recv(d, f)
            assert [tuple(t.shape) for t in out] == [
                (CAPACITY * K, H),
                (CAPACITY, H),
                (CAPACITY * K,),
                (CAPACITY,),
                (3,),
                (E_R,),
                (1,),
            ]
            assert out[0].dtype == out[1].dtype == torch.float32
            tokens, source, layer = out[4].tolist()
            x, ids = sources[source]
            assert (tokens, layer) == (x.shape[0], 5)
            rows, counts = expected_rows(x, ids, f)
            assert out[5].tolist() == counts
            assert torch.equal(out[0][: len(rows)], torch.stack(rows) if rows else x[:0])
            shared_rows = x.shape[0] if f == source % F else 0  # every source's tokens go to one FFN rank
            assert int(out[6][0]) == shared_rows and torch.equal(out[1][:shared_rows], x[:shared_rows])
            received[(f, source)] = out
    assert sum(received[(1, 1)][5].tolist()) == 0  # FFN 1 got a message with zero routed rows
    for (f, _source), out in received.items():
        routed, shared = ffn_compute(out, f)
        combine_send(d, routed, shared, out[4], f)
    ids0 = sources[0][1]
    with pytest.raises(RuntimeError, match="do not pair with the oldest outstanding dispatch"):
        combine_recv(d, ids0[:2], weights[0][:2], rank=0)
    for s, (x, ids) in sources.items():
        combined = combine_recv(d, ids, weights[s], rank=s)
        assert combined.shape == (x.shape[0], H) and combined.dtype == torch.float32
        assert torch.allclose(combined, expected_combine(x, ids, weights[s]), atol=1e-5)
    with pytest.raises(RuntimeError, match="no outstanding dispatch"):
        combine_recv(d, ids0, weights[0], rank=0)
    assert d.fabric.pending() == 0


def test_camasync_combine_send_needs_a_real_routed_row() -> None:
    d = CamAsyncDoubles(Fabric(timeout_s=2))
    header = torch.tensor([1, 0, 0])
    with pytest.raises(RuntimeError, match="non-empty"):
        combine_send(d, torch.empty(0, H), torch.empty(0, H), header, ffn=1)
    with pytest.raises(RuntimeError, match="int8"):
        combine_send(d, torch.zeros(1, H, dtype=torch.int8), torch.empty(0, H), header, ffn=1)
    # a zero-row dispatch takes exactly one placeholder row back, not two
    x = torch.randn(2, H)
    ids = torch.tensor([[0, 1], [1, 0]])  # all on FFN 0; FFN 1 receives zero routed rows (and no shared: 0 % 2 = 0)
    for _ in range(2):
        dispatch_send(d, x, ids, rank=0, layer=0)
        dispatch_recv(d, 0)
    headers = [dispatch_recv(d, 1)[4] for _ in range(2)]
    assert [h.tolist() for h in headers] == [[2, 0, 0]] * 2
    with pytest.raises(RuntimeError, match="exactly one placeholder row"):
        combine_send(d, torch.zeros(2, H), torch.empty(0, H), headers[0], ffn=1)
    combine_send(d, torch.zeros(1, H), torch.empty(0, H), headers[1], ffn=1)
    message = d.fabric.take(channel=("combine", "g", 0), dst=0)
    assert (message.src, message.payload["routed"].shape[0]) == (A + 1, 0)  # the placeholder does not travel


def test_quantize_and_route_helpers() -> None:
    """``dynamic_quant=1``: int8 rows with one float32 scale per row (symmetric, per row); routing as documented."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, H, generator=g) * torch.tensor([[1.0], [10.0], [0.1], [3.0], [1.0]])
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5,)
    for row in range(5):
        step = float(x[row].abs().max()) / 127
        assert abs(float(s[row]) - step) <= 1e-6 * step
        assert int(q[row].abs().max()) == 127  # the row's largest value maps to the int8 limit
        assert torch.all((q[row].float() * step - x[row]).abs() <= step / 2 + 1e-6)
    ids = torch.randint(0, F * E_R, (6, K), generator=g)
    for f in range(F):
        positions, local = route_rows(ids, f, E_R)
        expected = [(t * K + k, e) for e in range(E_R) for t in range(6) for k in range(K) if ids[t, k] == f * E_R + e]
        assert list(zip(positions.tolist(), local.tolist(), strict=True)) == expected
    # the same contract through the operators: an int8 dispatch arrives with its scales
    d = CamAsyncDoubles(Fabric(timeout_s=2))
    dispatch_send(d, x[:2], torch.tensor([[0, 2], [1, 3]]), rank=0, layer=0, quant=1)
    out = dispatch_recv(d, 0, quant=1)
    assert out[0].dtype == out[1].dtype == torch.int8 and out[2].dtype == out[3].dtype == torch.float32
    for row, token in enumerate((0, 1)):  # FFN 0: expert 0 <- token 0, expert 1 <- token 1
        step = float(x[token].abs().max()) / 127
        assert abs(float(out[2][row]) - step) <= 1e-6 * step
        assert torch.all((out[0][row].float() * out[2][row] - x[token]).abs() <= step / 2 + 1e-6)
        assert torch.all((out[1][row].float() * out[3][row] - x[token]).abs() <= step / 2 + 1e-6)  # shared: 0 % 2


def test_camasync_fifo_per_source_destination_and_layer_later_layers_overtake() -> None:
    """A delayed stage-0 transfer keeps its layer's stage 1 behind it; the next layer overtakes both."""

    def delay(m: Message) -> float:
        return 0.2 if m.channel[0] == "dispatch" and m.payload["tokens"] == 3 else 0.0

    d = CamAsyncDoubles(Fabric(delay=delay, timeout_s=2))
    batches = [(0, torch.randn(3, H)), (0, torch.randn(2, H)), (1, torch.randn(1, H))]  # (layer, x)
    ids = {n: torch.zeros(n, K, dtype=torch.int64) for n in (1, 2, 3)}  # expert 0 only (FFN 0)
    for layer, x in batches:
        dispatch_send(d, x, ids[x.shape[0]], rank=0, layer=layer)
    order = [dispatch_recv(d, 0) for _ in batches]
    assert [out[4].tolist()[::2] for out in order] == [[1, 1], [3, 0], [2, 0]]  # (tokens, layer)
    assert d.fabric.overtakes == 1
    # combine pairs with the oldest outstanding dispatch (layer 0, 3 tokens) whatever the FFN sent back first
    weights = {n: torch.full((n, K), 0.5) for n in (1, 2, 3)}
    for out in order:
        routed, shared = ffn_compute(out, 0)
        combine_send(d, routed, shared, out[4], 0)
    for _ in batches:  # FFN 1 got a zero-row message per dispatch: it answers with the one-row placeholder
        out = dispatch_recv(d, 1)
        combine_send(d, torch.zeros(1, H), out[1][: int(out[6][0])], out[4], 1)
    for layer, x in batches:
        combined = combine_recv(d, ids[x.shape[0]], weights[x.shape[0]], rank=0)
        assert torch.allclose(combined, expected_combine(x, ids[x.shape[0]], weights[x.shape[0]]), atol=1e-5), layer


# --------------------------------------------------------------------------- CAMP2P


def a2e(d: CamP2PDoubles, x: torch.Tensor, batch_size: int, rank: int, ffn: int, attention: int, group: str = "afd0"):
    # x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size, attention_rank_size, rank,
    # group_ep, aiv_num, compute_gate
    return d.a2e(x, None, None, batch_size, H, K, ffn, attention, rank, group, 8, 0)


def e2a(d: CamP2PDoubles, x: torch.Tensor, counts: torch.Tensor, rank: int, ffn: int, attention: int):
    # expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size, attention_rank_size, rank,
    # group_ep, aiv_num
    return d.e2a(x, counts, x.shape[0], H, K, ffn, attention, rank, "afd0", 8)


def test_camp2p_ffn_gathers_its_attention_ranks_in_order() -> None:
    """World ranks FFN 0..F-1 then attention F..F+A-1; FFN r serves attention r*g .. r*g+g-1 (g = A/F)."""
    ffn, attention = 2, 4
    d = CamP2PDoubles(Fabric(timeout_s=2))
    g = torch.Generator().manual_seed(2)
    rows = {rank: torch.randn(rank - 1, H, generator=g, dtype=torch.float64) for rank in range(ffn, ffn + attention)}
    for rank in sorted(rows, reverse=True):  # sent out of rank order; gathered in rank order
        sent = a2e(d, rows[rank], rows[rank].shape[0], rank, ffn, attention)
        assert len(sent) == 5 and tuple(sent[3].shape) == (attention // ffn,)  # placeholders on the attention side
    for r in range(ffn):
        mine = [ffn + r * 2 + i for i in range(2)]
        real = sum(rows[a].shape[0] for a in mine)
        batch = real + 1
        expand_x, expert_ids, scales, counts, mask = a2e(
            d, torch.empty(0, H, dtype=torch.float64), batch, r, ffn, attention
        )
        assert [tuple(t.shape) for t in (expand_x, expert_ids, scales, counts, mask)] == [
            (batch, H),
            (batch, K),
            (batch, K),
            (2,),
            (batch,),
        ]
        assert expand_x.dtype == torch.float64  # deviation on purpose: the input dtype, not bf16
        assert counts.dtype == torch.int32 and mask.dtype == torch.bool
        assert counts.tolist() == [rows[a].shape[0] for a in mine]
        assert mask.tolist() == [True] * real + [False] * (batch - real)
        assert torch.equal(expand_x[:real], torch.cat([rows[a] for a in mine])) and not expand_x[real:].any()
        # e2a splits the FFN output back by atten_batch_size; each attention rank receives its own rows
        assert e2a(d, expand_x[:real] * 2, counts, r, ffn, attention).shape == (1, 1)
    for rank, x in rows.items():
        back = e2a(d, x, torch.zeros(1, dtype=torch.int32), rank, ffn, attention)
        assert back.dtype == x.dtype and torch.equal(back, x * 2)
    a2e(d, rows[2], 1, 2, ffn, attention)
    a2e(d, rows[3], 2, 3, ffn, attention)
    with pytest.raises(RuntimeError, match="3 rows received for batch_size 2"):  # the real kernel would overrun
        a2e(d, torch.empty(0, H), 2, 0, ffn, attention)
    with pytest.raises(RuntimeError, match="multiple of FFN ranks"):
        a2e(d, rows[2], 1, 2, 2, 3)


def test_camp2p_fifo_per_group_and_pair_other_stage_groups_overtake() -> None:
    """The HCCL group between two ranks is a FIFO; another stage's group is not held behind it."""

    def delay(m: Message) -> float:
        return 0.2 if m.payload["x"].shape[0] == 3 else 0.0

    d = CamP2PDoubles(Fabric(delay=delay, timeout_s=2))
    first, second, other = torch.ones(3, H), torch.full((2, H), 2.0), torch.full((1, H), 5.0)
    a2e(d, first, 3, 1, 1, 1)  # delayed
    a2e(d, second, 2, 1, 1, 1)  # same group, same pair: stays behind the first
    a2e(d, other, 1, 1, 1, 1, group="afd1")  # the other stage's group
    assert torch.equal(a2e(d, torch.empty(0, H), 1, 0, 1, 1, group="afd1")[0], other)
    assert torch.equal(a2e(d, torch.empty(0, H), 3, 0, 1, 1)[0], first)
    assert torch.equal(a2e(d, torch.empty(0, H), 2, 0, 1, 1)[0], second)
    assert d.fabric.overtakes == 1


def test_doubles_refuse_an_argument_list_that_is_not_the_operators() -> None:
    d = CamP2PDoubles(Fabric(timeout_s=2))
    with pytest.raises(TypeError, match=r"a2e double: .*group_ep, aiv_num, compute_gate"):
        d.a2e(torch.zeros(1, H), None, None, 1, H, K, 1, 1, 1, "afd0", 8)  # compute_gate missing
    with pytest.raises(ValueError, match="unknown operators"):
        CamAsyncDoubles(Fabric(), foreign=("a2e",))


# --------------------------------------------------------------------------- the probe run against the doubles


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
