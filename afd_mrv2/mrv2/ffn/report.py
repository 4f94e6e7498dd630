"""What an FFN rank's serving session reports: :class:`FfnReport` (counted by every loop while it serves,
printed as ``afd-mrv2 ffn: done {...}`` when the session ends) and :func:`overlap_figures` (what the
loops' traces say about overlap).  Filled by :func:`afd_mrv2.mrv2.ffn.server.serve_ffn`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from afd_mrv2.items import WorkItem
from afd_mrv2.live_stats import FfnFigures
from afd_mrv2.mrv2.memory import current_memory
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.pipeline.metrics import busy_ns, covered_ns, hidden_comm_fraction, makespan_ns
from afd_mrv2.pipeline.trace import Trace


@dataclass
class FfnReport:
    """How an FFN serving session went (thread-safe: every loop records into it).

    ``items``: work items served, all Attention ranks together (``items_per_attention``
    per rank): one per MoE layer per Attention forward, whether or not a token of
    it was routed here.  ``computed``: those with at least one token here (the
    expert computations, ``busy_s`` long in all; ``tokens_per_item`` counts them
    by token count).  ``items_by_stage_count``: items served per stage count as the
    wire named it (``{1: ...}`` unsplit steps, ``{2: ...}`` steps of two micro-batches).
    ``redispatched``: of the items, the re-sends an Attention rank made here after it lost another FFN
    rank holding the same experts (expert replicas).  ``ranks_per_call``: per expert computation, how many
    Attention ranks contributed rows to it (a rank that sent 0 rows does not count; an Attention group's
    ranks meet in one computation, M:N).
    """

    moe_layers: int
    computed: int = 0
    busy_s: float = 0.0
    end: str = ""
    redispatched: int = 0
    tokens_per_item: Counter[int] = field(default_factory=Counter)
    items_per_attention: Counter[int] = field(default_factory=Counter)
    items_by_stage_count: Counter[int] = field(default_factory=Counter)
    ranks_per_call: Counter[int] = field(default_factory=Counter)
    #: attention rank index -> why its loop ended
    ends: dict[int, str] = field(default_factory=dict)
    #: attention rank index -> its executor at the end: pipelined (multistream) or serialized, buffers in/out
    executors: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: overlap figures from the loops' traces (``multistream.trace``), else None
    overlap: dict[str, Any] | None = None
    #: attention rank index -> its last loop's FFN-side stamps (``FfnStamps.as_dict()``: items, mean stamps;
    #: docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.stamps")
    round_trip_stamps: dict[int, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def items(self) -> int:
        return sum(self.items_per_attention.values())

    def item_seen(self, item: WorkItem) -> None:
        """An item's headers arrived (the connector's ``on_item``): count it by its stage count."""
        with self._lock:
            self.items_by_stage_count[item.num_stages] += 1

    def rows_seen(self, item: WorkItem, rows: Sequence[int]) -> None:
        """An item's rows per Attention rank of its loop, before its compute (the connector's ``on_rows``)."""
        del item
        contributors = sum(1 for n in rows if n)
        if contributors:
            with self._lock:
                self.ranks_per_call[contributors] += 1

    def record(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.computed += 1
            self.busy_s += seconds
            self.tokens_per_item[tokens] += 1

    def figures(self, *, redispatched: int, up_s: float) -> FfnFigures:
        """The live figures serve's ``/metrics`` shows (:mod:`afd_mrv2.live_stats`): the running counts, with
        the re-sends the rank's connectors served (``redispatched``), its time serving (``up_s``) and what it
        read and holds (:func:`~afd_mrv2.mrv2.memory.current_memory`)."""
        with self._lock:
            return FfnFigures(
                items=sum(self.items_by_stage_count.values()),
                computed=self.computed,
                tokens=sum(t * n for t, n in self.tokens_per_item.items()),
                busy_s=round(self.busy_s, 6),
                redispatched=redispatched,
                up_s=up_s,
                memory=current_memory(),
                ranks_per_call=dict(self.ranks_per_call),
            )

    def loop_ended(self, attention: int, served: int, end: str, executor: Executor, redispatched: int = 0) -> None:
        """Attention rank ``attention``'s loop ended after serving ``served`` items (``redispatched`` re-sends);
        a restarted engine's next loop adds to its counts, its end replaces the last."""
        with self._lock:
            self.redispatched += redispatched
            self.items_per_attention[attention] += served
            self.ends[attention] = end
            self.executors[attention] = {
                "pipelined": executor.pipelined,
                "buffers": [executor.depth_in, executor.depth_out],
            }
            self.end = self.end or end  # the first loop's reason is the session's

    def waiting_ended(self, attention: int, end: str) -> None:
        """The wait for Attention rank ``attention``'s next incarnation ended without a loop (``end`` says why)."""
        with self._lock:
            self.ends.setdefault(attention, end)
            self.end = self.end or end

    def add_overlap(self, figures: dict[str, Any]) -> None:
        self.overlap = figures

    def loop_stamps(self, attention: int, stamps: dict[str, Any]) -> None:
        """Attention rank ``attention``'s loop ended with these stamps (its connector's ``FfnStamps.as_dict()``);
        a restarted engine's next loop replaces them (its Attention side counts afresh too)."""
        with self._lock:
            self.round_trip_stamps[attention] = stamps

    def as_dict(self) -> dict[str, Any]:
        return {
            "moe_layers": self.moe_layers,
            "items": self.items,
            "items_per_attention": {str(a): n for a, n in sorted(self.items_per_attention.items())},
            "items_by_stage_count": {str(n): c for n, c in sorted(self.items_by_stage_count.items())},
            "computed": self.computed,
            "expert_calls": self.computed,
            "ranks_per_call": {str(n): c for n, c in sorted(self.ranks_per_call.items())},
            "tokens_per_call": round(sum(t * n for t, n in self.tokens_per_item.items()) / self.computed, 2)
            if self.computed
            else 0.0,
            "redispatched": self.redispatched,
            "busy_s": round(self.busy_s, 6),
            "end": self.end,
            "ends": {str(a): text for a, text in sorted(self.ends.items())},
            "executors": {str(a): info for a, info in sorted(self.executors.items())},
            "tokens_per_item": dict(sorted(self.tokens_per_item.items())),
            "overlap": self.overlap,
            "round_trip_stamps": {str(a): stamps for a, stamps in sorted(self.round_trip_stamps.items())},
        }


def overlap_figures(traces: Sequence[Trace]) -> dict[str, Any]:
    """What the loops' traces say about overlap, all loops of the rank together.

    Only spans that ran count (one opened for the item the session ended on never
    started).  ``hidden_comm_fraction``: the share of recv+send time during which an
    expert computation ran (1.0: communication fully hidden); ``send_hidden_fraction``
    the same for sends alone.  A serving recv also waits, idle, for the engine's next
    forward, so the recv share is a lower bound.  With one Attention engine nothing
    can overlap on this path (the engine waits for each result before sending its
    next item); with several, one engine's transfers run under another's compute.
    ``busy_ms``: per stream, the time it ran a phase; ``compute_ms``: the union of
    the compute spans; ``active_ms``: first to last span.
    """
    ran = [[span for span in trace.spans if 0 < span.start_ns <= span.end_ns] for trace in traces]
    spans = [span for loop in ran for span in loop]
    if not spans:
        return {"items": 0}
    busy: dict[str, float] = {}
    for loop in ran:  # per loop: each executor has streams of its own, under the same names
        for stream, ns in busy_ns(loop).items():
            busy[stream] = busy.get(stream, 0.0) + ns / 1e6
    compute = [s for s in spans if s.name == "compute"]
    sends = [s for s in spans if s.name == "send"]
    return {
        "items": len(compute),
        "hidden_comm_fraction": round(hidden_comm_fraction(spans), 4),
        "send_hidden_fraction": round(hidden_comm_fraction(compute + sends), 4),
        "compute_ms": round(covered_ns(compute) / 1e6, 3),
        "busy_ms": {k: round(v, 3) for k, v in sorted(busy.items())},
        "active_ms": round(makespan_ns(spans) / 1e6, 3),
    }
