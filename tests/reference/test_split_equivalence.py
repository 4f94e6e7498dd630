"""Split vs unsplit on the reference model: the async-MoE stages compute the same numbers.

Acceptance (issue 6, item 2): max |diff| <= 1e-5 (fp32) between the model run
in the planner's two stages (layer-major, KV cache per layer, MoE per stage,
stages merged) and the unsplit single-process reference, for the token and the
request split, including ONE long prefill that the token split cuts mid-request
(stage 2 continues it as a chunked prefill with stage 1 in its KV context).

Negative controls make sure these tests can fail: attention without the KV
context of the continued request (what the old whole-request attention computes
on token-split stages) is off by O(1); stage 2 running before stage 1 reads
unwritten KV slots and raises.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afd_mrv2.reference import staged
from afd_mrv2.reference.batches import StageBatch, concat, make_batch
from afd_mrv2.reference.forward import reference_forward
from afd_mrv2.reference.kvcache import KvCache, KvCacheError, KvLayout
from afd_mrv2.reference.layers import self_attention
from afd_mrv2.reference.owners import FfnOwner, Schedule
from afd_mrv2.reference.spec import BatchSpec, ModelSpec
from afd_mrv2.reference.split_owner import SplitAttentionOwner
from afd_mrv2.reference.staged import plan_batch, staged_attention_step, staged_forward
from afd_mrv2.reference.weights import build_weights
from afd_mrv2.stages import PAD_SLOT_ID, build_stage_metadata
from afd_mrv2.topology import ATTENTION, Topology

TOL = 1e-5
SPEC = ModelSpec(hidden_size=64, num_layers=4, num_heads=4, num_experts=8, top_k=2, expert_size=96, shared_size=96)
WEIGHTS = build_weights(SPEC)


def tokens_for(lengths: tuple[int, ...], seed: int, spec: ModelSpec = SPEC) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (sum(lengths),), generator=g)


def split_diff(lengths: tuple[int, ...], split: str, seed: int = 0, **plan: object) -> tuple[float, staged.SplitBatch]:
    batch = plan_batch(lengths, split=split, seed=seed, **plan)  # type: ignore[arg-type]
    assert batch is not None, f"{split} split of {lengths}: no plan"
    tokens = tokens_for(lengths, seed)
    got = staged_forward(WEIGHTS, SPEC, tokens, batch)
    want = reference_forward(WEIGHTS, SPEC, tokens, lengths)
    assert got.shape == want.shape
    return float((got - want).abs().max()), batch


# lengths, split, the continued request (None: the split cuts no request)
CASES = [
    ((96,), "token", 0),  # ONE long prefill, cut mid-request: 48 + 48 with 48 tokens of context
    ((97,), "token", 0),  # odd: 49 + 48
    ((20, 17, 30, 9), "token", 2),  # request 2 crosses the cut with 1 token in stage 1
    ((5, 40, 3), "token", 1),  # a long request in the middle, 19 tokens of context
    ((60, 2), "token", 0),  # the cut inside the first request; the short one only in stage 2
    ((33, 33), "token", None),  # the cut falls on a boundary: both stages have zero context
    ((1, 1), "token", None),
    ((20, 17, 30, 9), "request", None),
    ((5, 40, 3), "request", None),
    ((1, 50, 1, 1), "request", None),
]


@pytest.mark.parametrize(("lengths", "split", "continued"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_staged_forward_matches_the_unsplit_reference(
    lengths: tuple[int, ...], split: str, continued: int | None, seed: int
) -> None:
    diff, batch = split_diff(lengths, split, seed)
    assert diff <= TOL, f"{batch.describe()}: max |diff| {diff:.2e}"
    assert batch.continued == ([] if continued is None else [continued]), batch.describe()
    second = batch.metadata[1]
    if continued is None:
        assert int(second.context_lens.max()) == 0 and int(batch.metadata[0].context_lens.max()) == 0
    else:
        # stage 2 keeps the full length of the continued request; its context is the stage-1 part
        ctx = batch.summary()["continued"][0]
        assert (
            ctx["seq_len"] == lengths[continued]
            and ctx["context"] + ctx["query"] == ctx["seq_len"] > ctx["context"] > 0
        )


def test_the_single_long_prefill_is_split_mid_request() -> None:
    diff, batch = split_diff((96,), "token")
    assert diff <= TOL
    assert batch.describe() == (
        "token split: stage 1 = 48 tokens (request 0), stage 2 = 48 tokens (request 0), "
        "request 0 continued (stage 2 prefills its positions 48..95 over 48 tokens of KV context)"
    )
    assert plan_batch((96,), split="request") is None  # the request split has no plan for one request


@pytest.mark.parametrize("split", ["token", "request"])
def test_sequence_parallel_padding_rows_do_not_change_the_real_tokens(split: str) -> None:
    diff, batch = split_diff((20, 17, 30, 9), split, tp_size=4, sequence_parallel=True)
    assert diff <= TOL
    assert any(s.num_padding for s in batch.stages)
    assert all(
        int(m.slot_mapping[s.num_tokens :].eq(PAD_SLOT_ID).all())
        for m, s in zip(batch.metadata, batch.stages, strict=True)
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    split=st.sampled_from(["token", "request"]),
    seed=st.integers(0, 2**16),
)
def test_property_split_equals_unsplit_for_random_request_lengths(lengths: list[int], split: str, seed: int) -> None:
    batch = plan_batch(lengths, split=split, seed=seed)
    if batch is None:  # request split of one request, token split of one token
        assert (split == "request" and len(lengths) == 1) or sum(lengths) == 1
        return
    spec = dataclasses.replace(SPEC, num_layers=2)
    weights = build_weights(spec)
    tokens = tokens_for(tuple(lengths), seed, spec)
    diff = float(
        (staged_forward(weights, spec, tokens, batch) - reference_forward(weights, spec, tokens, lengths)).abs().max()
    )
    assert diff <= TOL, f"{batch.describe()}: {diff:.2e}"


# ------------------------------------------------------------------ negative controls


def no_context_attention(x, w, num_heads, meta, block_tables, layout, cache, layer):  # type: ignore[no-untyped-def]
    """The broken variant: each stage attends only over its own tokens (the continued request loses its context)."""
    out = torch.zeros_like(x)
    n = meta.stage.num_tokens
    out[:n] = self_attention(x[:n], w, num_heads, meta.query_lens.tolist())
    return out


@pytest.mark.parametrize("lengths", [(96,), (20, 17, 30, 9)])
def test_negative_control_dropping_the_kv_context_exceeds_the_tolerance(
    lengths: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staged, "chunked_self_attention", no_context_attention)
    broken, _ = split_diff(lengths, "token")
    assert broken > 100 * TOL, f"dropping the KV context went unnoticed: {broken:.2e}"
    if len(lengths) > 1:  # the request split never needs the context: the same broken attention is still exact
        assert split_diff(lengths, "request")[0] <= TOL


def test_negative_control_stage_2_before_stage_1_reads_unwritten_kv() -> None:
    batch = plan_batch((96,), split="token")
    assert batch is not None
    cache = staged.new_cache(SPEC, batch)
    h = staged.stage_embeddings(WEIGHTS, tokens_for((96,), 0), batch)
    with pytest.raises(KvCacheError, match="read before any stage wrote them"):
        staged_attention_step(WEIGHTS, SPEC, 0, h[1], batch, 1, cache)


def test_positions_that_do_not_continue_the_context_are_refused() -> None:
    batch = plan_batch((20, 17, 30, 9), split="token")
    assert batch is not None
    meta = batch.metadata[1]
    shifted = build_stage_metadata(
        meta.stage,
        query_start_loc=[0, 20, 37, 67, 76],
        seq_lens=[20, 17, 30, 9],
        positions=torch.zeros(76, dtype=torch.int64),  # every token claims position 0
        slot_mapping=torch.arange(76),
    )
    broken = dataclasses.replace(batch, metadata=(batch.metadata[0], shifted))
    cache = staged.new_cache(SPEC, broken)
    h = staged.stage_embeddings(WEIGHTS, tokens_for((20, 17, 30, 9), 0), broken)
    staged_attention_step(WEIGHTS, SPEC, 0, h[0], broken, 0, cache)
    with pytest.raises(ValueError, match="do not continue its context"):
        staged_attention_step(WEIGHTS, SPEC, 0, h[1], broken, 1, cache)


# ------------------------------------------------------------------ KV cache and layout


def test_kv_layout_slots_are_distinct_paged_and_not_token_indices() -> None:
    layout = KvLayout.allocate([20, 17, 30, 9], block_size=8, seed=3)
    assert [len(t) for t in layout.block_tables] == [3, 3, 4, 2] and layout.num_blocks == 12
    slots = layout.slot_mapping([torch.arange(n) for n in (20, 17, 30, 9)])
    assert slots.unique().numel() == 76 and int(slots.max()) < layout.num_slots
    assert not torch.equal(slots, torch.arange(76))
    assert torch.equal(
        layout.slots(layout.block_tables[2], torch.tensor([9])), torch.tensor([layout.block_tables[2][1] * 8 + 1])
    )
    with pytest.raises(ValueError, match="past the request's"):
        layout.slots(layout.block_tables[3], torch.tensor([16]))


def test_kv_cache_skips_padding_slots_and_refuses_unwritten_reads() -> None:
    cache = KvCache(num_layers=2, num_slots=8, hidden=4)
    k = torch.arange(12.0).view(3, 4)
    cache.write(1, torch.tensor([5, PAD_SLOT_ID, 2]), k, -k)
    keys, values = cache.read(1, torch.tensor([2, 5]))
    assert torch.equal(keys, k[[2, 0]]) and torch.equal(values, -k[[2, 0]])
    assert int(cache.written.sum()) == 2
    with pytest.raises(KvCacheError, match="first: \\[3\\]"):
        cache.read(1, torch.tensor([2, 3]))
    with pytest.raises(KvCacheError):
        cache.read(0, torch.tensor([5]))  # written on layer 1 only


# ------------------------------------------------------------------ the embedded run's owner, in process


def afd_in_process(owners: list[SplitAttentionOwner], ffn: list[FfnOwner], topo: Topology, schedule: Schedule) -> None:
    """Items in executor order; the FFN ranks' partial outputs summed per (attention rank, stage)."""
    combined: dict[tuple[int, int], torch.Tensor] = {}
    for item in schedule.items(ATTENTION, [0]):
        routed = [owner.compute(item, combined.pop((a, item.stage_idx), None)) for a, owner in enumerate(owners)]
        if routed[0] is None:
            continue
        for a, (x, ids, weights) in enumerate(routed):  # type: ignore[misc]
            total = torch.zeros_like(x)
            for f, owner in enumerate(ffn):
                experts = topo.experts_of(f)
                pick = ((ids >= experts.start) & (ids < experts.stop)).any(1).nonzero().squeeze(1)
                if pick.numel():
                    total.index_add_(0, pick, owner.compute(item, x[pick], ids[pick], weights[pick]))
            combined[(a, item.stage_idx)] = total


@pytest.mark.parametrize(
    ("split", "batch_spec"),
    [
        ("token", BatchSpec(stages=1, requests_per_stage=4, min_len=16, max_len=32)),
        ("request", BatchSpec(stages=1, requests_per_stage=4, min_len=16, max_len=32)),
        ("token", BatchSpec(stages=1, requests_per_stage=1, min_len=96, max_len=96)),
    ],
)
def test_split_attention_owner_in_the_afd_dataflow_matches_the_reference(
    split: str, batch_spec: BatchSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    topo = Topology(2, 2, SPEC.num_experts)
    schedule = Schedule(SPEC.num_layers, 2)

    def run() -> list[float]:
        owners = [
            SplitAttentionOwner(
                SPEC, WEIGHTS, schedule, {0: make_batch(batch_spec, SPEC.vocab_size, a, 0)}, split=split
            )
            for a in range(2)
        ]
        afd_in_process(owners, [FfnOwner(SPEC, WEIGHTS, topo, f) for f in range(2)], topo, schedule)
        diffs = []
        for owner in owners:
            whole = concat(owner.batches[0])
            assert (split == "token") == bool(owner.plans[0].continued), owner.plans[0].describe()
            assert not owner._caches, "the KV cache of a finished batch is dropped"
            diffs.append(
                float((owner.output(0) - reference_forward(WEIGHTS, SPEC, whole.tokens, whole.lengths)).abs().max())
            )
        return diffs

    assert max(run()) <= TOL
    if split == "token":
        monkeypatch.setattr(staged, "chunked_self_attention", no_context_attention)
        assert min(run()) > 100 * TOL  # the same check catches a split that drops the context


def test_split_owner_runs_a_batch_the_planner_cannot_split_unsplit_and_checks_the_schedule() -> None:
    """Alone (no DP group decision), a rank whose batch has no two-stage plan runs it as one stage."""
    one = {0: [StageBatch(tokens=torch.arange(8, dtype=torch.int64), lengths=(8,))]}
    owner = SplitAttentionOwner(SPEC, WEIGHTS, Schedule(SPEC.num_layers, 2, {0: 1}), one, split="request")
    assert (
        len(owner.plans[0].stages) == 1 and "no two-stage plan (1 request(s), 8 token(s))" in owner.plans[0].unsplit_why
    )
    with pytest.raises(ValueError, match="the plan has 1 stage"):
        SplitAttentionOwner(SPEC, WEIGHTS, Schedule(SPEC.num_layers, 2), one, split="request")
