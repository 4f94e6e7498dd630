"""Serialized vs pipelined on the simulated link: the overlap demo and benchmark.

recv and send each cost ``phase_s`` of simulated transfer (a sleep: no CPU),
compute runs about ``phase_s`` of real matmuls on one thread.  Every mode runs the
same work items through the same connector, so the outputs must match exactly and
the ratios are measured side by side in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import load_plugins

ROWS, WIDTH = 64, 256


@dataclass(frozen=True)
class ModeResult:
    label: str
    depth: int  # for depth "auto": the depth it chose
    pipelined: bool
    wall_s: float
    trace: Trace
    outputs: dict[WorkItem, torch.Tensor]
    window: int = 0  # items measured before an "auto" choice (0: fixed depth)

    def row(self, serialized_wall_s: float, reference: dict[WorkItem, torch.Tensor]) -> dict[str, object]:
        metrics = self.trace.metrics()
        diff = max((float((self.outputs[k] - v).abs().max()) for k, v in reference.items()), default=0.0)
        return {
            "mode": self.label,
            "depth": self.depth,
            "makespan_ms": metrics.makespan_ns / 1e6,
            "lower_bound_ms": metrics.lower_bound_ns / 1e6,
            "efficiency": metrics.efficiency,
            "hidden_comm_fraction": metrics.hidden_comm_fraction,
            "speedup": serialized_wall_s / self.wall_s,
            "max_abs_diff": diff,
        }


def calibrated_compute(target_s: float, *, seed: int = 0) -> Callable[[WorkItem, torch.Tensor], torch.Tensor]:
    """A deterministic matmul chain taking about ``target_s`` on the current thread count."""
    weight = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(seed)) / WIDTH**0.5
    probe = torch.randn(ROWS, WIDTH)
    for _ in range(3):
        torch.tanh(probe @ weight)  # warm up
    start = time.perf_counter()
    for _ in range(20):
        torch.tanh(probe @ weight)
    one = (time.perf_counter() - start) / 20
    reps = max(1, round(target_s / one))

    def compute(item: WorkItem, x: torch.Tensor) -> torch.Tensor:
        for _ in range(reps):
            x = torch.tanh(x @ weight)
        return x

    return compute


def run_mode(
    *,
    items: int,
    depth: int | str,
    pipelined: bool,
    compute: Callable[[WorkItem, torch.Tensor], torch.Tensor],
    phase_s: float | None = None,
    recv_s: float | None = None,
    send_s: float | None = None,
    auto_window: int = 8,
    backend: str = "host",
) -> ModeResult:
    """One executor run of ``items`` items; recv/send cost ``recv_s``/``send_s`` (default ``phase_s``)."""
    outputs: dict[WorkItem, torch.Tensor] = {}
    recv_s = phase_s if recv_s is None else recv_s
    send_s = phase_s if send_s is None else send_s
    if recv_s is None or send_s is None:
        raise ValueError("give phase_s, or both recv_s and send_s")
    link = {"recv_latency_us": recv_s * 1e6, "send_latency_us": send_s * 1e6, "bandwidth_gbps": 0}
    multistream = {"enabled": pipelined, "depth": depth, "auto_window": auto_window, "backend": backend, "trace": True}
    config = parse_afd_config(
        {"connector": "simlink", "role": "ffn", "connector_extra_config": link, "multistream": multistream}
    )

    def source(item: WorkItem) -> torch.Tensor:
        return torch.full((ROWS, WIDTH), (item.seq % 17) / 17.0) + torch.arange(WIDTH) / WIDTH

    plugins = load_plugins(config, resources={"source": source, "sink": outputs.__setitem__})
    label = f"pipelined d={depth}" if pipelined else "serialized"
    trace = Trace(role="ffn", label=label)
    executor = Executor(plugins, make_backend(backend), config.multistream, compute=compute, trace=trace)
    start = time.perf_counter()
    with executor:
        executor.run(WorkItem(i % 4, (i // 4) % 2, i) for i in range(items))
    wall = time.perf_counter() - start
    choice = executor.depth_choice
    if choice is not None:
        return ModeResult(f"auto -> d={choice.depth}", choice.depth, pipelined, wall, trace, outputs, choice.window)
    if depth == "auto" and pipelined:
        label = f"auto (undecided: fewer than {auto_window} items completed in time; ran at d={executor.depth})"
    return ModeResult(label, executor.depth, pipelined, wall, trace, outputs)


def compare(
    *, items: int = 32, depths: tuple[int, ...] = (2,), phase_s: float = 0.005, backend: str = "host"
) -> tuple[list[dict[str, object]], list[ModeResult]]:
    """Serialized first, then pipelined at each depth: one table row and one result per mode."""
    torch.set_num_threads(1)
    compute = calibrated_compute(phase_s)
    serial = run_mode(items=items, depth=1, pipelined=False, phase_s=phase_s, compute=compute, backend=backend)
    results = [serial] + [
        run_mode(items=items, depth=d, pipelined=True, phase_s=phase_s, compute=compute, backend=backend)
        for d in depths
    ]
    return [r.row(serial.wall_s, serial.outputs) for r in results], results
