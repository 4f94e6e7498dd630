"""Stage-local metadata rebuild: table cases and properties against the parent batch."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd_mrv2.stages import PAD_SLOT_ID, build_stage_metadata, merge_tokens, plan_stages, split_tokens


def parent(counts: list[int], cached: list[int]) -> dict:
    """A parent batch: request r has ``cached[r]`` tokens in the KV cache and ``counts[r]`` scheduled."""
    qsl = list(accumulate(counts, initial=0))
    positions = [c + i for c, n in zip(cached, counts, strict=True) for i in range(n)]
    return {
        "query_start_loc": qsl,
        "seq_lens": [c + n for c, n in zip(cached, counts, strict=True)],
        "positions": positions,
        "slot_mapping": [
            1000 + p + 100 * r for r, (c, n) in enumerate(zip(cached, counts, strict=True)) for p in range(c, c + n)
        ],
    }


def test_single_long_prefill_split_mid_request() -> None:
    meta = parent([7], [0])
    first, second = (build_stage_metadata(s, **meta) for s in plan_stages([7], split="token"))
    assert first.query_start_loc.tolist() == [0, 4]
    assert first.seq_lens.tolist() == [4]  # tokens 4..6 are not cached yet
    assert first.context_lens.tolist() == [0]
    assert first.positions.tolist() == [0, 1, 2, 3]
    # stage 2 continues the request: full sequence length, context = stage-1 tokens
    assert second.query_start_loc.tolist() == [0, 3]
    assert second.seq_lens.tolist() == [7]
    assert second.context_lens.tolist() == [4]
    assert second.positions.tolist() == [4, 5, 6]
    assert second.slot_mapping.tolist() == [1004, 1005, 1006]


def test_chunked_prefill_with_cache_and_padding() -> None:
    meta = parent([3, 5, 1], [10, 2, 40])
    stages = plan_stages([3, 5, 1], split="token", tp_size=4, sequence_parallel=True)
    first, second = (build_stage_metadata(s, **meta) for s in stages)
    # t = 5: request 1 (tokens 3..7) is cut after its 2nd token
    assert first.query_start_loc.tolist() == [0, 3, 5]
    assert first.seq_lens.tolist() == [13, 4]
    assert first.context_lens.tolist() == [10, 2]
    assert first.positions.tolist() == [10, 11, 12, 2, 3, 0, 0, 0]
    assert first.slot_mapping.tolist()[5:] == [PAD_SLOT_ID] * 3
    assert second.query_start_loc.tolist() == [0, 3, 4]
    assert second.seq_lens.tolist() == [7, 41]
    assert second.context_lens.tolist() == [4, 40]
    assert second.positions.tolist() == [4, 5, 6, 40]
    assert (second.max_query_len, second.max_seq_len) == (3, 41)


def test_request_split_keeps_requests_whole() -> None:
    meta = parent([5, 3, 4], [0, 6, 1])
    first, second = (build_stage_metadata(s, **meta) for s in plan_stages([5, 3, 4], split="request"))
    assert first.seq_lens.tolist() == [5] and first.context_lens.tolist() == [0]
    assert second.seq_lens.tolist() == [9, 5] and second.context_lens.tolist() == [6, 1]
    assert second.query_start_loc.tolist() == [0, 3, 7]


def test_rejects_inconsistent_parent() -> None:
    stage = plan_stages([4], split="token")[0]
    with pytest.raises(ValueError, match="query_start_loc"):
        build_stage_metadata(stage, query_start_loc=[1, 4], seq_lens=[4], positions=range(4), slot_mapping=range(4))
    with pytest.raises(ValueError, match="at least 4 entries"):
        build_stage_metadata(stage, query_start_loc=[0, 4], seq_lens=[4], positions=range(3), slot_mapping=range(4))
    with pytest.raises(ValueError, match="seq_lens"):
        build_stage_metadata(stage, query_start_loc=[0, 4], seq_lens=[3], positions=range(4), slot_mapping=range(4))
    with pytest.raises(ValueError, match="integer"):
        build_stage_metadata(stage, query_start_loc=[0.0, 4.0], seq_lens=[4], positions=range(4), slot_mapping=range(4))


batches = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=12)


@given(batches, st.sampled_from(["request", "token"]), st.integers(1, 8), st.booleans())
def test_stages_recompose_the_parent(batch: list[tuple[int, int]], split: str, tp: int, sp: bool) -> None:
    counts, cached = [c for c, _ in batch], [k for _, k in batch]
    plan = plan_stages(counts, split=split, tp_size=tp, sequence_parallel=sp)
    if plan is None:
        return
    meta = parent(counts, cached)
    stages = [build_stage_metadata(s, **meta) for s in plan]
    # positions and slots: the real rows concatenate back to the parent's, padding is inert
    assert torch.cat([m.positions[: m.stage.num_tokens] for m in stages]).tolist() == meta["positions"]
    assert torch.cat([m.slot_mapping[: m.stage.num_tokens] for m in stages]).tolist() == meta["slot_mapping"]
    for m in stages:
        assert m.positions.shape[0] == m.stage.num_input_tokens
        assert set(m.slot_mapping[m.stage.num_tokens :].tolist()) <= {PAD_SLOT_ID}
        assert int(m.query_start_loc[-1]) == m.stage.num_tokens
        assert bool((m.context_lens >= 0).all())
        # context + query = seq len, and the first query token sits at position == context
        firsts = m.positions[m.query_start_loc[:-1].long()]
        assert firsts.tolist() == m.context_lens.tolist()
    # per request: query lengths add up, the last stage holding it sees the full sequence
    seen: dict[int, int] = {}
    last_len: dict[int, int] = {}
    for m in stages:
        for j, r in enumerate(range(m.stage.request_slice.start, m.stage.request_slice.stop)):
            seen[r] = seen.get(r, 0) + int(m.query_lens[j])
            last_len[r] = int(m.seq_lens[j])
    assert [seen[r] for r in range(len(counts))] == counts
    assert [last_len[r] for r in range(len(counts))] == meta["seq_lens"]


@given(st.lists(st.integers(1, 30), min_size=1, max_size=10), st.sampled_from(["request", "token"]), st.integers(1, 4))
def test_merge_inverts_split(counts: list[int], split: str, tp: int) -> None:
    plan = plan_stages(counts, split=split, tp_size=tp, sequence_parallel=True)
    if plan is None:
        return
    hidden = torch.randn(sum(counts), 3)
    parts = split_tokens(hidden, plan)
    assert [p.shape[0] for p in parts] == [s.num_input_tokens for s in plan]
    assert torch.equal(merge_tokens(parts, plan), hidden)


def test_merge_checks_shapes() -> None:
    plan = plan_stages([4], split="token")
    with pytest.raises(ValueError, match="one output per stage"):
        merge_tokens([torch.zeros(2, 1)], plan)
    with pytest.raises(ValueError, match="expected 2 rows"):
        merge_tokens([torch.zeros(2, 1), torch.zeros(3, 1)], plan)
