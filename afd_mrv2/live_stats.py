"""Live figures of a role process, for ``afd-mrv2 serve``'s ``/metrics`` and ``/afd/status``.

A vLLM Attention engine computes its MoE layers in its EngineCore's worker process and an
FFN rank in its worker too; neither is the process serve talks HTTP to.  So each role
process writes what it counted to a small JSON file, at most once per
:data:`WRITE_EVERY_S` and at once when something notable happened (a failover): the
folder is ``$AFD_MRV2_STATS_DIR`` (serve sets it per role to its run folder), the file
``<role>-<rank>.json``.  A write goes to a temporary file first and is renamed over the
old one, so a reader never sees half a document.  Without the variable nothing is
written.  serve reads the files when scraped (:mod:`afd_mrv2.serve.metrics`).

Documents (every key optional to the reader; ``at``: ``time.time()`` of the write; ``pid``: the
writing process, so a restarted role's figures, which start from 0 again, are told apart):

* Attention: ``calls``, ``tokens``, ``round_trip_seconds`` (a histogram: ``buckets``
  upper bounds, cumulative ``counts`` per bound, ``sum``, ``count``),
  ``round_trip_total_s`` / ``hidden_total_s`` (the share of round-trip time under
  another micro-batch's compute), ``failover`` (:class:`~afd_mrv2.hooks.p2p.failover.FailoverLog`);
* FFN: ``items``, ``redispatched``, ``computed``, ``tokens``, ``busy_s``, ``up_s``.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATS_DIR_ENV = "AFD_MRV2_STATS_DIR"
WRITE_EVERY_S = 1.0
#: Upper bounds (seconds) of the Attention side's round-trip histogram.
ROUND_TRIP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def stats_path(role: str, rank: int) -> Path | None:
    """Where role ``role`` rank ``rank`` writes its figures; None without ``$AFD_MRV2_STATS_DIR``."""
    folder = os.environ.get(STATS_DIR_ENV)
    return Path(folder) / f"{role}-{rank}.json" if folder else None


class StatsWriter:
    """Writes ``build()`` to ``path`` at most every ``every_s`` (or at once with ``force``); thread-safe."""

    def __init__(self, path: Path | None, build: Callable[[], dict[str, Any]], every_s: float = WRITE_EVERY_S) -> None:
        self.path = path
        self.build = build
        self.every_s = every_s
        self._last = 0.0
        self._lock = threading.Lock()

    def maybe_write(self, *, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        if not self._lock.acquire(blocking=force):
            return  # another thread is writing right now
        try:
            self._last = now
            doc = {**self.build(), "at": round(time.time(), 3), "pid": os.getpid()}
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(doc, sort_keys=True))
                os.replace(tmp, self.path)
            except OSError:  # the run folder is gone (serve is stopping): figures are best effort
                pass
        finally:
            self._lock.release()


class Histogram:
    """A cumulative histogram over :data:`ROUND_TRIP_BUCKETS` (Prometheus' shape); thread-safe."""

    def __init__(self, buckets: tuple[float, ...] = ROUND_TRIP_BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * len(buckets)
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            index = bisect.bisect_left(self.buckets, seconds)
            if index < len(self._counts):
                self._counts[index] += 1
            self._sum += seconds
            self._count += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            cumulative, total = [], 0
            for n in self._counts:
                total += n
                cumulative.append(total)
            return {"buckets": list(self.buckets), "counts": cumulative, "sum": self._sum, "count": self._count}


def read_stats(folder: str | Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Every role's last document in ``folder``: ``{(role, rank): doc}`` (unreadable files are left out)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        paths = list(Path(folder).glob("*-*.json"))
    except OSError:
        return out
    for path in paths:
        role, _, rank = path.stem.rpartition("-")
        if not rank.isdigit():
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out[(role, int(rank))] = doc
    return out
