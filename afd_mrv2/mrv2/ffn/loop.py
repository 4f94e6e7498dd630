"""The FFN side's step loop, driven by the shared executor.

Per engine step the FFN side serves every (layer, stage) the Attention side sends:
one work item each, in the Attention side's order (layer-major, then microbatch
or async-MoE stage).  ``step()`` only submits: it does not drain and never
synchronizes the device.  The executor's slot waits bound the work in flight
(``multistream.depth``); items of step ``n+1`` start while those of step ``n``
are still sending.  This replaces the upstream AFD plugin's serial
recv -> compute -> send loop with a ``torch.npu.synchronize()`` per step.
"""

from __future__ import annotations

import itertools

from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline.executor import CloseReport, Executor


class FfnLoop:
    def __init__(self, executor: Executor, *, num_layers: int, num_stages: int) -> None:
        if num_layers < 1 or num_stages < 1:
            raise ValueError(f"num_layers and num_stages must be >= 1, got {num_layers} and {num_stages}")
        self.executor = executor
        self.num_layers = num_layers
        self.num_stages = num_stages
        self.steps = 0
        self.submitted = 0  # items the executor accepted (a step may end half-way when the executor fails)
        self._seq = itertools.count()

    def step(self) -> None:
        """Submit one step's work items; returns while they may still be in flight."""
        for layer in range(self.num_layers):
            for stage in range(self.num_stages):
                self.executor.submit(WorkItem(layer, stage, next(self._seq), num_stages=self.num_stages))
                self.submitted += 1
        self.steps += 1

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def close(self, deadline_s: float | None = None) -> CloseReport:
        """Finish in-flight work (the only drain) and stop the executor."""
        return self.executor.close(deadline_s)
