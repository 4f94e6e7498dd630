"""stalled_ffn_ranks: which FFN ranks an engine lost while their current process runs."""

from __future__ import annotations

from afd_mrv2.live_stats import AttentionFigures, FailoverFigures, FfnFigures, Histogram, LostRank, Written
from afd_mrv2.serve.stalls import stalled_ffn_ranks


def _engine(lost: dict[int, float], rejoined: dict[int, float]) -> Written:
    failover = FailoverFigures(
        failovers=len(lost),
        lost={f: LostRank(at=at, reason=f"lost {f}") for f, at in lost.items()},
        first_resend_at={},
        resent_items=0,
        resent_rows=0,
        rejoins=len(rejoined),
        rejoined_at=rejoined,
    )
    figures = AttentionFigures(
        calls=1,
        tokens=1,
        round_trip_seconds=Histogram().figures(),
        round_trip_total_s=0.0,
        hidden_total_s=0.0,
        failover=failover,
        memory=None,
    )
    return Written(figures=figures, at=0.0, pid=1)


def test_a_rank_lost_after_its_process_started_and_not_taken_back_is_stalled() -> None:
    ffn = FfnFigures(items=0, computed=0, tokens=0, busy_s=0.0, redispatched=0, up_s=0.0, memory=None)
    figures = {
        ("attention", 0): _engine({0: 105.0, 1: 105.0, 2: 90.0}, {1: 106.0}),
        ("attention", 1): _engine({0: 107.0, 3: 108.0}, {}),
        ("ffn", 0): Written(figures=ffn, at=0.0, pid=2),
    }
    since = {0: 100.0, 1: 100.0, 2: 100.0}  # rank 3's process is not running (not in since)
    # 0: lost by both engines, named by the first; 1: taken back since; 2: lost by an earlier process
    assert stalled_ffn_ranks(figures, since) == {0: (0, "lost 0")}
    assert stalled_ffn_ranks(figures, {0: 106.0}) == {0: (1, "lost 0")}  # only engine 1's loss is this process's
    assert stalled_ffn_ranks({}, since) == {}
