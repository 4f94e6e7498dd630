"""Table tests of ``plan_stages``: the exact semantics from issue 6."""

from __future__ import annotations

import pytest

from afd_mrv2.stages import Stage, plan_stages


def shape(plan: tuple[Stage, Stage] | None) -> list[tuple] | None:
    if plan is None:
        return None
    return [
        ((s.request_slice.start, s.request_slice.stop), (s.token_slice.start, s.token_slice.stop), s.num_input_tokens)
        for s in plan
    ]


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        # total 12, cu 0 5 8 12: i=1 -> |10-12|=2, i=2 -> |16-12|=4
        ([5, 3, 4], [((0, 1), (0, 5), 5), ((1, 3), (5, 12), 7)]),
        # total 8, cu 0 2 4 6 8: i=2 exact
        ([2, 2, 2, 2], [((0, 2), (0, 4), 4), ((2, 4), (4, 8), 4)]),
        # total 10, cu 0 1 9 10: i=1 -> 8, i=2 -> 8: tie on tokens; |2-3|=1 both: smaller i
        ([1, 8, 1], [((0, 1), (0, 1), 1), ((1, 3), (1, 10), 9)]),
        # total 4, cu 0 1 2 3 4: i=2 exact
        ([1, 1, 1, 1], [((0, 2), (0, 2), 2), ((2, 4), (2, 4), 2)]),
        # total 6, cu 0 1 2 6: i=1 -> 4, i=2 -> 2
        ([1, 1, 4], [((0, 2), (0, 2), 2), ((2, 3), (2, 6), 4)]),
        # cu 0 2 3 4 6: exact half at i=2
        ([2, 1, 1, 2], [((0, 2), (0, 3), 3), ((2, 4), (3, 6), 3)]),
        # total 7, cu 0 3 4 7, n=3: i=1 -> |6-7|=1, i=2 -> |8-7|=1; |2-3|=1 == |4-3|=1: smaller i
        ([3, 1, 3], [((0, 1), (0, 3), 3), ((1, 3), (3, 7), 4)]),
        # n=5, total 10, cu 0 1 5 6 9 10: i=2 -> 0 exact
        ([1, 4, 1, 3, 1], [((0, 2), (0, 5), 5), ((2, 5), (5, 10), 5)]),
        ([100, 1], [((0, 1), (0, 100), 100), ((1, 2), (100, 101), 1)]),
        ([7], None),
    ],
)
def test_request_split(counts: list[int], expected: list | None) -> None:
    assert shape(plan_stages(counts, split="request")) == expected


def test_request_tie_breaks_on_request_balance_then_index() -> None:
    # [3,1,1,1,1]: cu 0 3 4 5 6 7; i=1 and i=2 both miss the half by 1 token;
    # request balance |2-5|=3 vs |4-5|=1 picks the LARGER index i=2
    assert shape(plan_stages([3, 1, 1, 1, 1], split="request"))[0][0] == (0, 2)
    # [1,1,1,4,1,2]: cu 0 1 2 3 7 8 10; i=3 and i=4 both miss by 4; |6-6|=0 beats |8-6|=2 -> i=3
    assert shape(plan_stages([1, 1, 1, 4, 1, 2], split="request"))[0][0] == (0, 3)
    # [1,2,1,2,1]: cu 0 1 3 4 6 7; i=2 and i=3 tie on tokens (1) and on balance (1): smaller i
    assert shape(plan_stages([1, 2, 1, 2, 1], split="request"))[0][0] == (0, 2)


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        # one long prefill, cut in the middle: the request is in both stages
        ([7], [((0, 1), (0, 4), 4), ((0, 1), (4, 7), 3)]),
        ([8], [((0, 1), (0, 4), 4), ((0, 1), (4, 8), 4)]),
        ([2], [((0, 1), (0, 1), 1), ((0, 1), (1, 2), 1)]),
        # cut exactly on a boundary: no request in both
        ([2, 2], [((0, 1), (0, 2), 2), ((1, 2), (2, 4), 2)]),
        # total 9, t = 5: request 1 (tokens 3..8) straddles
        ([3, 5, 1], [((0, 2), (0, 5), 5), ((1, 3), (5, 9), 4)]),
        ([1, 1, 1], [((0, 2), (0, 2), 2), ((2, 3), (2, 3), 1)]),
        ([1], None),
    ],
)
def test_token_split(counts: list[int], expected: list | None) -> None:
    assert shape(plan_stages(counts, split="token")) == expected


def test_padding_only_under_sequence_parallelism() -> None:
    assert shape(plan_stages([7], split="token", tp_size=4)) == [((0, 1), (0, 4), 4), ((0, 1), (4, 7), 3)]
    assert shape(plan_stages([7], split="token", tp_size=4, sequence_parallel=True)) == [
        ((0, 1), (0, 4), 4),
        ((0, 1), (4, 7), 4),
    ]
    assert shape(plan_stages([5, 3, 4], split="request", tp_size=2, sequence_parallel=True)) == [
        ((0, 1), (0, 5), 6),
        ((1, 3), (5, 12), 8),
    ]
    # tp_size 1 under SP pads nothing
    assert shape(plan_stages([5, 3], split="request", sequence_parallel=True)) == [
        ((0, 1), (0, 5), 5),
        ((1, 2), (5, 8), 3),
    ]


def test_stage_properties() -> None:
    first, second = plan_stages([7], split="token", tp_size=4, sequence_parallel=True)
    assert (first.index, second.index) == (0, 1)
    assert (second.num_tokens, second.num_padding, second.num_requests) == (3, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_scheduled_tokens": [], "split": "token"}, "empty list"),
        ({"num_scheduled_tokens": [3, 0], "split": "token"}, r"num_scheduled_tokens\[1\]: expected a positive"),
        ({"num_scheduled_tokens": [3, -2], "split": "request"}, "positive token count, got -2"),
        ({"num_scheduled_tokens": [3], "split": "token", "tp_size": 0}, "tp_size: expected an integer >= 1"),
        ({"num_scheduled_tokens": [3], "split": "layer"}, "split: expected one of request, token, got 'layer'"),
        ({"num_scheduled_tokens": [3], "split": None}, "split: expected one of"),
        ({"num_scheduled_tokens": [3.5], "split": "token"}, "expected an integer"),
        ({"num_scheduled_tokens": [True], "split": "token"}, "expected an integer"),
        # the error wins over "no plan": an unknown split with one request still raises
        ({"num_scheduled_tokens": [1], "split": "tokens"}, "split: expected"),
        ({"num_scheduled_tokens": [], "split": "request"}, "empty list"),
    ],
)
def test_invalid_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_stages(**kwargs)


def test_accepts_integer_like_counts() -> None:
    import torch

    plan = plan_stages(torch.tensor([5, 3, 4]).tolist(), split="request")
    assert plan is not None
    import numpy as np

    assert shape(plan_stages(np.array([5, 3, 4]), split="request")) == shape(plan)
