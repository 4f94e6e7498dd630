"""Hypothesis properties of ``plan_stages``."""

from __future__ import annotations

from itertools import accumulate

from hypothesis import given
from hypothesis import strategies as st

from afd_mrv2.stages import plan_stages

counts_st = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=40)
split_st = st.sampled_from(["request", "token"])
tp_st = st.integers(min_value=1, max_value=16)


@given(counts_st, split_st, tp_st, st.booleans())
def test_every_token_in_exactly_one_stage_in_order(counts: list[int], split: str, tp: int, sp: bool) -> None:
    plan = plan_stages(counts, split=split, tp_size=tp, sequence_parallel=sp)
    if plan is None:
        return
    total = sum(counts)
    tokens = [t for s in plan for t in range(s.token_slice.start, s.token_slice.stop)]
    assert tokens == list(range(total))  # each token once, order kept, nothing dropped
    assert all(s.num_tokens > 0 for s in plan)
    assert [s.index for s in plan] == [0, 1]


@given(counts_st, split_st, tp_st, st.booleans())
def test_physical_at_least_actual_and_sp_alignment(counts: list[int], split: str, tp: int, sp: bool) -> None:
    plan = plan_stages(counts, split=split, tp_size=tp, sequence_parallel=sp)
    if plan is None:
        return
    for s in plan:
        assert s.num_input_tokens >= s.num_tokens
        if sp:
            assert s.num_input_tokens % tp == 0
            assert s.num_input_tokens - s.num_tokens < tp  # minimal padding
        else:
            assert s.num_input_tokens == s.num_tokens


@given(counts_st, split_st)
def test_request_slices_cover_exactly_the_requests_with_tokens_in_the_stage(counts: list[int], split: str) -> None:
    plan = plan_stages(counts, split=split)
    if plan is None:
        return
    cu = list(accumulate(counts, initial=0))
    for s in plan:
        holding = [r for r in range(len(counts)) if cu[r] < s.token_slice.stop and cu[r + 1] > s.token_slice.start]
        assert list(range(s.request_slice.start, s.request_slice.stop)) == holding
    first, second = plan
    shared = set(range(first.request_slice.start, first.request_slice.stop)) & set(
        range(second.request_slice.start, second.request_slice.stop)
    )
    if split == "request":
        assert not shared
        assert first.token_slice.stop == cu[first.request_slice.stop]
    else:
        assert len(shared) <= 1  # at most the one request crossing the cut


@given(counts_st)
def test_request_split_is_the_documented_argmin(counts: list[int]) -> None:
    plan = plan_stages(counts, split="request")
    n, cu = len(counts), list(accumulate(counts, initial=0))
    if n < 2:
        assert plan is None
        return
    best = sorted(range(1, n), key=lambda i: (abs(2 * cu[i] - cu[-1]), abs(2 * i - n), i))[0]
    assert plan is not None and plan[0].request_slice == slice(0, best)


@given(counts_st)
def test_token_split_cuts_at_the_ceiling_half(counts: list[int]) -> None:
    plan = plan_stages(counts, split="token")
    total = sum(counts)
    if total < 2:
        assert plan is None
        return
    assert plan is not None
    assert plan[0].token_slice == slice(0, (total + 1) // 2)
    assert 0 <= plan[0].num_tokens - plan[1].num_tokens <= 1
