"""The tiny reference MoE model: seeded, and its AFD decomposition adds up to the whole.

The in-process AFD simulation here runs the exact compute functions the
attention and FFN ranks of ``afd-mrv2 run`` use, with the transport replaced by
plain indexing, so a mismatch points at the math split, not at the transport.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from afd_mrv2.reference.batches import concat, make_batch
from afd_mrv2.reference.forward import attention_step, reference_forward
from afd_mrv2.reference.layers import moe_partial
from afd_mrv2.reference.owners import AttentionOwner, FfnOwner, Schedule
from afd_mrv2.reference.spec import BatchSpec, ModelSpec, with_routing
from afd_mrv2.reference.weights import build_weights
from afd_mrv2.topology import ATTENTION, Topology

SMALL = ModelSpec(hidden_size=32, num_layers=3, num_heads=4, num_experts=8, top_k=2, expert_size=48, shared_size=48)
BATCH = BatchSpec(stages=3, requests_per_stage=2, min_len=4, max_len=9)


def test_weights_and_batches_are_deterministic() -> None:
    a, b = build_weights(SMALL), build_weights(SMALL)
    assert torch.equal(a.layers[2].experts_w13, b.layers[2].experts_w13) and torch.equal(a.embed, b.embed)
    c = build_weights(dataclasses.replace(SMALL, seed=1))
    assert not torch.equal(a.embed, c.embed)
    s1, s2 = make_batch(BATCH, 512, 1, 3), make_batch(BATCH, 512, 1, 3)
    assert all(torch.equal(x.tokens, y.tokens) and x.lengths == y.lengths for x, y in zip(s1, s2, strict=True))
    assert not torch.equal(concat(s1).tokens, concat(make_batch(BATCH, 512, 0, 3)).tokens)
    for stage in s1:
        assert (
            all(4 <= n <= 9 for n in stage.lengths) and stage.tokens.numel() == sum(stage.lengths) <= BATCH.max_tokens
        )


def test_reference_forward_is_finite_and_order_one() -> None:
    w = build_weights(SMALL)
    whole = concat(make_batch(BATCH, SMALL.vocab_size, 0, 0))
    out = reference_forward(w, SMALL, whole.tokens, whole.lengths)
    assert out.shape == (whole.tokens.numel(), SMALL.hidden_size)
    assert torch.isfinite(out).all() and 0.3 < out.pow(2).mean().sqrt() < 3


@pytest.mark.parametrize("num_ffn", [1, 2, 4])
def test_expert_shards_plus_shared_on_top1_owner_sum_to_the_full_moe(num_ffn: int) -> None:
    torch.manual_seed(0)
    w = build_weights(SMALL)
    topo = Topology(4, num_ffn, SMALL.num_experts)
    x = torch.randn(40, SMALL.hidden_size)
    _, x, ids, weights = attention_step(w, SMALL, 0, x, [40])
    full = moe_partial(x, ids, weights, w.layers[0], range(SMALL.num_experts), None)
    parts = torch.zeros_like(full)
    for f in range(num_ffn):
        experts = topo.experts_of(f)
        top1 = (ids[:, 0] >= experts.start) & (ids[:, 0] < experts.stop)
        parts += moe_partial(x, ids, weights, w.layers[0], experts, top1)
    assert (parts - full).abs().max() < 1e-5


def routed_ids(spec: ModelSpec) -> torch.Tensor:
    w = build_weights(spec)
    whole = concat(make_batch(BATCH, spec.vocab_size, 0, 0))
    h = w.embed.index_select(0, whole.tokens)
    return attention_step(w, spec, 0, h, whole.lengths)[2]


def test_routing_scenarios() -> None:
    topo = Topology(2, 2, SMALL.num_experts)
    skewed = routed_ids(with_routing(SMALL, "skewed", topo))
    assert (skewed == 0).any(dim=1).float().mean() >= 0.7  # one expert gets >= 70% of tokens
    idle = routed_ids(with_routing(SMALL, "idle-rank", topo))
    assert not ((idle >= 4) & (idle < 8)).any()  # the last FFN rank's experts are never chosen
    balanced = routed_ids(with_routing(SMALL, "balanced", topo))
    assert (balanced == 0).any(dim=1).float().mean() < 0.7
    with pytest.raises(ValueError, match="at least 2 FFN ranks"):
        with_routing(SMALL, "idle-rank", Topology(2, 1, 8))
    with pytest.raises(ValueError, match="exceeds"):
        dataclasses.replace(SMALL, blocked_experts=tuple(range(7)))


@pytest.mark.parametrize(("num_ffn", "routing"), [(1, "skewed"), (2, "balanced"), (2, "idle-rank")])
def test_afd_dataflow_in_process_matches_the_reference(num_ffn: int, routing: str) -> None:
    """Attention owners + FFN owners + combine by token index == the single-process forward."""
    topo = Topology(2, num_ffn, SMALL.num_experts)
    spec = with_routing(SMALL, routing, topo)
    w = build_weights(spec)
    schedule = Schedule(spec.num_layers, BATCH.stages)
    attention = [AttentionOwner(spec, w, schedule, {0: make_batch(BATCH, spec.vocab_size, a, 0)}) for a in range(2)]
    ffn = [FfnOwner(spec, w, topo, f) for f in range(num_ffn)]
    combined: dict[tuple[int, int], torch.Tensor] = {}
    for item in schedule.items(ATTENTION, [0]):
        routed = []
        for a, owner in enumerate(attention):
            out = owner.compute(item, combined.pop((a, item.stage_idx), None))
            routed.append(out)
        if routed[0] is None:
            continue
        for f, owner in enumerate(ffn):  # the FFN rank batches the tokens of every attention rank
            experts = topo.experts_of(f)
            picks = [
                ((ids >= experts.start) & (ids < experts.stop)).any(1).nonzero().squeeze(1) for _, ids, _ in routed
            ]
            if sum(p.numel() for p in picks) == 0:
                continue
            y = owner.compute(
                item,
                torch.cat([x[p] for (x, _, _), p in zip(routed, picks, strict=True)]),
                torch.cat([ids[p] for (_, ids, _), p in zip(routed, picks, strict=True)]),
                torch.cat([wt[p] for (_, _, wt), p in zip(routed, picks, strict=True)]),
            )
            start = 0
            for a, (p, (x, _, _)) in enumerate(zip(picks, routed, strict=True)):
                part = combined.setdefault((a, item.stage_idx), torch.zeros_like(x))
                part.index_add_(0, p, y[start : start + p.numel()])
                start += p.numel()
    for owner in attention:
        whole = concat(owner.batches[0])
        got = torch.cat([owner.outputs[(0, s)] for s in range(BATCH.stages)])
        assert (got - reference_forward(w, spec, whole.tokens, whole.lengths)).abs().max() <= 1e-5
    if routing == "idle-rank":
        assert ffn[-1].tokens == 0 and ffn[0].tokens > 0
