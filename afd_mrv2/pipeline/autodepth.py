"""``depth: "auto"``: measure the first work items, choose the depth once.

The executor runs the first ``window`` items at the largest depth, with every
phase timed (host: on the stream thread; accelerator: timing events).  Once they
completed (checked without blocking), it replays the measured samples through
the analytic model, takes the smallest depth within 5 % of unbounded depth, logs
the choice and its inputs (per-phase medians) once, and keeps that depth for the
rest of its life: no re-tuning, so no oscillation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from afd_mrv2.devices.base import Span
from afd_mrv2.pipeline.metrics import stage_times
from afd_mrv2.pipeline.schedule_model import PhaseTimes, choose_depth, median_phase_times

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DepthChoice:
    depth: int
    times_ms: PhaseTimes  # per-phase medians over the window, in ms
    window: int

    def describe(self) -> str:
        t = self.times_ms
        return (
            f"depth auto -> {self.depth} (median over {self.window} items: recv {t.recv:.3f} ms, "
            f"compute {t.compute:.3f} ms, send {t.send:.3f} ms)"
        )


class DepthTuner:
    """Collects the window's spans and makes the one-time choice."""

    def __init__(self, window: int, max_depth: int) -> None:
        self.window = window
        self.max_depth = max_depth
        self.spans: list[Span] = []
        self.choice: DepthChoice | None = None

    @property
    def measuring(self) -> bool:
        """True until the choice is made."""
        return self.choice is None

    def observe(self, spans: list[Span]) -> None:
        """Take the resolved spans of one completed item."""
        self.spans += spans

    def ready(self) -> bool:
        """True once ``window`` items have all three phases measured."""
        phases: dict[object, int] = {}
        for span in self.spans:
            phases[span.item] = phases.get(span.item, 0) + 1
        return sum(1 for n in phases.values() if n == 3) >= self.window

    def decide(self) -> DepthChoice:
        window = sorted(self.spans, key=lambda s: s.item.seq if s.item else -1)
        samples = [PhaseTimes(*(ns / 1e6 for ns in t)) for t in stage_times(window)][: self.window]
        times = median_phase_times([t.as_tuple() for t in samples])
        self.choice = DepthChoice(choose_depth(samples, max_depth=self.max_depth), times, len(samples))
        self.spans = []
        log.info("afd-mrv2 executor: %s", self.choice.describe())
        return self.choice
