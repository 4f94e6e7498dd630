"""The async-MoE layouts: three token counts, shards, the SP convert/restore round trip, the decision, the log."""

from __future__ import annotations

import pytest
import torch

from afd_mrv2.stages import merge_tokens, plan_stages
from afd_mrv2.stages.layout import (
    StageLayout,
    decide_split,
    gather_shards,
    layout_line,
    layout_log_enabled,
    pad_rows,
    round_up,
    step_layouts,
    take_shard,
    unsplit_stage,
)


def layouts_of_every_rank(stages, *, dp_max: int, layout: str, tp: int) -> list[list[StageLayout]]:
    return [step_layouts(stages, dp_max_tokens=dp_max, layout=layout, tp_size=tp, tp_rank=r) for r in range(tp)]


def test_a_split_step_drops_the_dp_padding_and_pads_each_stage_to_the_tp_size() -> None:
    stages = plan_stages([30, 7, 12], split="token", tp_size=2, sequence_parallel=True)
    assert stages is not None
    first, second = step_layouts(stages, dp_max_tokens=60, layout="sp", tp_size=2, tp_rank=1)
    assert (first.real_tokens, first.dp_padding, first.tp_padding) == (25, 0, 1)
    assert (second.real_tokens, second.dp_padding, second.tp_padding) == (24, 0, 0)
    assert first.physical_tokens == 26 and first.shard == slice(13, 26) and first.num_stages == 2


def test_an_unsplit_step_carries_the_dp_padding_then_the_tp_padding() -> None:
    (only,) = step_layouts([unsplit_stage([9])], dp_max_tokens=20, layout="tp", tp_size=3, tp_rank=2)
    assert (only.real_tokens, only.dp_padding, only.tp_padding, only.physical_tokens) == (9, 11, 1, 21)
    assert only.shard == slice(14, 21) and not only.split
    with pytest.raises(ValueError, match="below this rank's 9 real tokens"):
        step_layouts([unsplit_stage([9])], dp_max_tokens=8, layout="tp", tp_size=1, tp_rank=0)


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("split", ["token", "request"])
def test_sp_parent_shards_convert_into_stage_shards_and_restore(tp: int, split: str) -> None:
    """Convert (gather parent shards, slice the stage, pad, shard) then restore (gather, merge, re-shard):
    every rank ends with exactly its parent shard, and the stage shards together hold every real row once."""
    lengths, dp_max = [5, 11, 4], 23
    real = torch.arange(sum(lengths) * 2, dtype=torch.float32).view(-1, 2) + 1
    stages = plan_stages(lengths, split=split, tp_size=tp, sequence_parallel=True)
    assert stages is not None
    (parent,) = step_layouts([unsplit_stage(lengths)], dp_max_tokens=dp_max, layout="sp", tp_size=tp, tp_rank=0)
    parent_rows = pad_rows(real, parent.physical_tokens)
    parents = layouts_of_every_rank([unsplit_stage(lengths)], dp_max=dp_max, layout="sp", tp=tp)
    shards = [take_shard(parent_rows, p[0]) for p in parents]
    gathered = gather_shards(shards[0], parents[0][0], lambda _t: shards)
    assert torch.equal(gathered, parent_rows)
    per_rank = layouts_of_every_rank(stages, dp_max=dp_max, layout="sp", tp=tp)
    stage_shards = [
        [
            take_shard(pad_rows(gathered[st.token_slice], lay.physical_tokens), lay)
            for st, lay in zip(stages, ls, strict=True)
        ]
        for ls in per_rank
    ]
    assert sum(s.shape[0] for ranks in stage_shards for s in ranks) == sum(lay.physical_tokens for lay in per_rank[0])
    restored = [
        gather_shards(stage_shards[0][i], per_rank[0][i], lambda _t, i=i: [r[i] for r in stage_shards])
        for i in range(len(stages))
    ]
    merged = merge_tokens(restored, stages)
    assert torch.equal(merged, real)
    for rank in range(tp):
        assert torch.equal(take_shard(pad_rows(merged, parent.physical_tokens), parents[rank][0]), shards[rank])


def test_take_and_gather_check_their_row_counts() -> None:
    (lay,) = step_layouts([unsplit_stage([4])], dp_max_tokens=4, layout="tp", tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="expected 4 physical rows, got 3"):
        take_shard(torch.zeros(3, 2), lay)
    with pytest.raises(ValueError, match="expected a 2-row shard, got 1"):
        gather_shards(torch.zeros(1, 2), lay, lambda t: [t, t])
    with pytest.raises(ValueError, match="returned 1 shards for tp_size 2"):
        gather_shards(torch.zeros(2, 2), lay, lambda t: [t])


def test_the_group_splits_only_when_every_rank_can() -> None:
    rows = {0: [1, 40, 4], 1: [0, 19, 1], 2: [1, 33, 3]}
    decision = decide_split(True, 40, 4, lambda mine: [rows[0], rows[1], rows[2]])
    assert not decision.split and decision.dp_max_tokens == 40
    assert decision.why == "rank 1 of the DP group has no two-stage plan (1 request(s), 19 token(s))"
    assert decide_split(True, 40, 4, lambda mine: [rows[0], rows[2]]).split
    alone = decide_split(True, 40, 4)  # an independent engine decides alone
    assert alone.split and alone.dp_max_tokens == 40 and alone.why == ""
    assert decide_split(False, 9, 1).why == "this rank has no two-stage plan (1 request(s), 9 token(s))"
    with pytest.raises(ValueError, match="from every rank"):
        decide_split(True, 1, 1, lambda mine: [[1, 2]])


def test_layout_line_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    (lay,) = step_layouts([unsplit_stage([9])], dp_max_tokens=20, layout="sp", tp_size=2, tp_rank=1)
    line = layout_line("attention dp 0 tp 1", 3, lay, split="request", why="rank 1 has 1 request")
    assert line == (
        "afd-mrv2 layout: attention dp 0 tp 1 step 3 stage 1/1 unsplit (rank 1 has 1 request), sp layout x tp 2: "
        "real 9 + dp padding 11 + tp padding 0 = 20 rows, shard rows 10..19 of tp rank 1"
    )
    monkeypatch.delenv("AFD_MRV2_LAYOUT_LOG", raising=False)
    monkeypatch.delenv("AFD_ASYNC_MOE_LAYOUT_LOG", raising=False)
    assert not layout_log_enabled()
    monkeypatch.setenv("AFD_MRV2_LAYOUT_LOG", "1")
    assert layout_log_enabled()
    monkeypatch.delenv("AFD_MRV2_LAYOUT_LOG")
    monkeypatch.setenv("AFD_ASYNC_MOE_LAYOUT_LOG", "1")  # the retired name: still read, with a deprecation
    with pytest.warns(DeprecationWarning, match="AFD_ASYNC_MOE_LAYOUT_LOG is deprecated .*: set AFD_MRV2_LAYOUT_LOG"):
        assert layout_log_enabled()
    assert round_up(7, 3) == 9


def test_a_layout_that_does_not_shard_evenly_is_refused() -> None:
    with pytest.raises(ValueError, match="does not shard evenly"):
        StageLayout(0, 1, "sp", 2, 0, real_tokens=3, dp_padding=0, tp_padding=0)
    with pytest.raises(ValueError, match="layout: expected one of sp, tp"):
        StageLayout(0, 1, "fc1", 1, 0, real_tokens=3, dp_padding=0, tp_padding=0)
