"""What the Attention runner reports about its engine steps: split or not, by batch kind, and forward times.

Batch kinds (from the step's ``InputBatch.is_prefilling_np``): ``decode`` (no request
prefilling), ``prefill`` (every request prefilling), ``mixed`` (both), ``dummy``
(vLLM's warm-up and profile runs).  The forward time is the model's forward only
(the wall time of ``model(...)`` unsplit, of the micro-batch runner's ``run`` split),
not the rest of the step (input preparation, sampling), which on vLLM's V2 runner
on CPU is dominated by Triton's interpreter.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from statistics import median
from typing import Any

#: Forward times kept per stage count (a window for medians; counters keep the totals).
_WINDOW = 4096


def batch_kind(is_prefilling: Iterable[object]) -> str:
    """``decode``, ``prefill`` or ``mixed`` from the step's per-request prefill flags."""
    flags = [bool(flag) for flag in is_prefilling]
    if not flags or not any(flags):
        return "decode"
    return "prefill" if all(flags) else "mixed"


class StepStats:
    """Counters of the runner's forwards (thread-safe; read through ``afd_attention_stats``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps: dict[str, Counter[int]] = defaultdict(Counter)  # kind -> stage count -> steps
        self.failed = 0
        self.forwards = 0  # every recorded forward, in order (the index of the next one)
        self._forward_ms: dict[int, deque[tuple[int, float]]] = defaultdict(lambda: deque(maxlen=_WINDOW))

    def record(self, kind: str, stages: int, forward_ns: int) -> None:
        with self._lock:
            self.steps[kind][stages] += 1
            self._forward_ms[stages].append((self.forwards, forward_ns / 1e6))
            self.forwards += 1

    def record_failure(self) -> None:
        with self._lock:
            self.failed += 1

    def as_dict(self) -> dict[str, Any]:
        """``steps`` {kind: {stage count: n}}, ``split_steps``, ``failed_steps``, ``forwards`` and per stage count
        the recent forward times: ``forward_ms`` {n: {"median", "count"}} and ``forward_ms_recent``
        {n: [[index, ms], ...]} (indices into all forwards, so a caller can cut a window)."""
        with self._lock:
            steps = {
                kind: {str(n): c for n, c in sorted(counts.items())} for kind, counts in sorted(self.steps.items())
            }
            recent = {n: list(times) for n, times in sorted(self._forward_ms.items())}
            split = sum(c for counts in self.steps.values() for n, c in counts.items() if n > 1)
            return {
                "steps": steps,
                "split_steps": split,
                "failed_steps": self.failed,
                "forwards": self.forwards,
                "forward_ms": {
                    str(n): {"median": round(median(ms for _, ms in times), 3), "count": len(times)}
                    for n, times in recent.items()
                    if times
                },
                "forward_ms_recent": {str(n): [[i, round(ms, 3)] for i, ms in times] for n, times in recent.items()},
            }
