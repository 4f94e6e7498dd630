"""``depth: "auto"``: measure the first work items, choose the buffer counts once.

The executor runs the first ``window`` items with the most buffers, with every
phase timed (host: on the stream thread; accelerator: timing events).  Once they
completed (checked without blocking), it replays the measured samples through
the analytic model and takes, among the (input, output) buffer counts within 5 %
of unbounded, the pair holding the fewest bytes (each buffer's bytes as measured
from the connector's tensors); it logs the choice and its inputs (per-phase
medians) once and keeps it for the rest of its life: no re-tuning, so no
oscillation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from afd_mrv2.devices.base import Span
from afd_mrv2.pipeline.metrics import stage_times
from afd_mrv2.pipeline.schedule_model import PhaseTimes, choose_buffers, median_phase_times

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DepthChoice:
    depth_in: int
    depth_out: int
    times_ms: PhaseTimes  # per-phase medians over the window, in ms
    window: int

    @property
    def depth(self) -> int:
        """The larger count (what ``multistream.depth`` would have to be to match)."""
        return max(self.depth_in, self.depth_out)

    @property
    def label(self) -> str:
        return f"{self.depth_in}in/{self.depth_out}out"

    def describe(self) -> str:
        t = self.times_ms
        return (
            f"depth auto -> {self.label} buffers (median over {self.window} items: recv {t.recv:.3f} ms, "
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

    def decide(self, bytes_in: int = 0, bytes_out: int = 0) -> DepthChoice:
        """Choose from the window's samples; ``bytes_in``/``bytes_out``: one buffer's measured bytes."""
        window = sorted(self.spans, key=lambda s: s.item.seq if s.item else -1)
        samples = [PhaseTimes(*(ns / 1e6 for ns in t)) for t in stage_times(window)][: self.window]
        times = median_phase_times([t.as_tuple() for t in samples])
        pick = choose_buffers(samples, bytes_in=bytes_in, bytes_out=bytes_out, max_depth=self.max_depth)
        self.choice = DepthChoice(pick.depth_in, pick.depth_out, times, len(samples))
        self.spans = []
        log.info("afd-mrv2 executor: %s", self.choice.describe())
        return self.choice
