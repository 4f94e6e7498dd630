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
from typing import Any

import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import FfnContext, load_plugins
from afd_mrv2.reference.buffer_report import buffer_block, counts_label

ROWS, WIDTH = 64, 256


@dataclass(frozen=True)
class ModeResult:
    label: str
    depth: int  # the larger buffer count; for depth "auto": of the counts it chose
    pipelined: bool
    wall_s: float
    trace: Trace
    outputs: dict[WorkItem, torch.Tensor]
    buffers: dict[str, Any]  # the buffer_block measured after drain, before close
    window: int = 0  # items measured before an "auto" choice (0: fixed depth)

    @property
    def depth_in(self) -> int:
        return int(self.buffers["in"])

    @property
    def depth_out(self) -> int:
        return int(self.buffers["out"])

    def row(self, serialized_wall_s: float, reference: dict[WorkItem, torch.Tensor]) -> dict[str, Any]:
        metrics = self.trace.metrics()
        diff = max((float((self.outputs[k] - v).abs().max()) for k, v in reference.items()), default=0.0)
        return {
            "mode": self.label,
            "depth": self.depth,
            "depth_in": self.depth_in,
            "depth_out": self.depth_out,
            "buffers": self.buffers,
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
    # The fastest of several short timings: a timing the scheduler interrupted (a loaded
    # machine) only ever runs slow, and would make the compute too short.
    timings = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(10):
            torch.tanh(probe @ weight)
        timings.append((time.perf_counter() - start) / 10)
    reps = max(1, round(target_s / min(timings)))

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
    depth_out: int | None = None,
    compute: Callable[[WorkItem, torch.Tensor], torch.Tensor],
    phase_s: float | None = None,
    recv_s: float | None = None,
    send_s: float | None = None,
    auto_window: int = 8,
    backend: str = "host",
) -> ModeResult:
    """One executor run of ``items`` items; recv/send cost ``recv_s``/``send_s`` (default ``phase_s``).

    ``depth`` sets both buffer counts, or only the input count when ``depth_out``
    is given (``multistream.buffers``); ``"auto"`` lets the executor choose.
    """
    outputs: dict[WorkItem, torch.Tensor] = {}
    recv_s = phase_s if recv_s is None else recv_s
    send_s = phase_s if send_s is None else send_s
    if recv_s is None or send_s is None:
        raise ValueError("give phase_s, or both recv_s and send_s")
    link = {"recv_latency_us": recv_s * 1e6, "send_latency_us": send_s * 1e6, "bandwidth_gbps": 0}
    multistream: dict[str, Any] = {"enabled": pipelined, "auto_window": auto_window, "backend": backend, "trace": True}
    if depth_out is None:
        multistream["depth"] = depth
    else:
        multistream["buffers"] = {"in": depth, "out": depth_out}
    config = parse_afd_config(
        {"connector": "simlink", "role": "ffn", "connector_extra_config": link, "multistream": multistream}
    )

    def source(item: WorkItem) -> torch.Tensor:
        return torch.full((ROWS, WIDTH), (item.seq % 17) / 17.0) + torch.arange(WIDTH) / WIDTH

    plugins = load_plugins(FfnContext(config=config, source=source, sink=outputs.__setitem__))
    counts = "auto" if config.multistream.auto_depth else counts_label(*config.multistream.buffer_counts)
    label = f"pipelined {counts}" if pipelined else "serialized"
    trace = Trace(role="ffn", label=label)
    executor = Executor(plugins, make_backend(backend), config.multistream, compute=compute, trace=trace)
    start = time.perf_counter()
    with executor:
        executor.run(WorkItem(i % 4, (i // 4) % 2, i) for i in range(items))
        buffers = buffer_block(executor)  # after drain, before close
    wall = time.perf_counter() - start
    choice = executor.depth_choice
    if choice is not None:
        return ModeResult(
            f"auto -> {choice.label}", choice.depth, pipelined, wall, trace, outputs, buffers, choice.window
        )
    if config.multistream.auto_depth and pipelined:
        ran = counts_label(executor.depth_in, executor.depth_out)
        label = f"auto (undecided: fewer than {auto_window} items completed in time; ran at {ran})"
    return ModeResult(label, executor.depth, pipelined, wall, trace, outputs, buffers)


def compare(
    *,
    items: int = 32,
    depths: tuple[int, ...] = (),
    buffers: tuple[tuple[int, int], ...] = (),
    phase_s: float = 0.005,
    backend: str = "host",
) -> tuple[list[dict[str, Any]], list[ModeResult]]:
    """Serialized first, then pipelined at each depth (d in + d out), then at each
    (in, out) pair of ``buffers``: one table row and one result per mode."""
    torch.set_num_threads(1)
    compute = calibrated_compute(phase_s)
    pairs = [(d, d) for d in depths] + list(buffers) or [(2, 2)]
    serial = run_mode(items=items, depth=1, pipelined=False, phase_s=phase_s, compute=compute, backend=backend)
    results = [serial] + [
        run_mode(
            items=items, depth=d_in, depth_out=d_out, pipelined=True, phase_s=phase_s, compute=compute, backend=backend
        )
        for d_in, d_out in pairs
    ]
    return [r.row(serial.wall_s, serial.outputs) for r in results], results
