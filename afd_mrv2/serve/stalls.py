"""Stalled FFN ranks: an Attention engine stopped routing to an FFN rank whose process still runs.

A rank that hangs or is stopped (SIGSTOP) is failed over by the engines after ``recv_timeout_s``, but its
process lives on, holding its memory and its place.  Serve reads the engines' live figures once a second
(:func:`stalled_ffn_ranks`) and ends such a rank's process group, so that the usual path (failover with
replicas, restart) takes over as for a crash.
"""

from __future__ import annotations

from collections.abc import Mapping

from afd_mrv2.live_stats import AttentionFigures, Written

#: How often serve looks for stalled FFN ranks.
STALL_LOOK_S = 1.0


def stalled_ffn_ranks(
    figures: Mapping[tuple[str, int], Written], since: Mapping[int, float]
) -> dict[int, tuple[int, str]]:
    """FFN rank -> (Attention rank, why) for each rank in ``since`` that an engine stopped routing to at or
    after ``since[rank]`` (``time.time()`` of that rank's current process start) and has not taken back."""
    stalled: dict[int, tuple[int, str]] = {}
    for (_, engine), written in sorted(figures.items()):
        record = written.figures
        if not isinstance(record, AttentionFigures) or record.failover is None:
            continue
        for f, lost in sorted(record.failover.lost.items()):
            back = record.failover.rejoined_at.get(f, 0.0)
            if f in since and lost.at >= since[f] and lost.at > back:
                stalled.setdefault(f, (engine, lost.reason))
    return stalled
