"""The accelerator backend on a real device (marker ``gpu``; deselected by default).

``pytest -m gpu`` on a machine without CUDA fails loudly (see conftest.py).
recv = host-to-device copy, compute = matmuls, send = device-to-host copy: real
device work on three streams, compared with the serialized schedule.
"""

from __future__ import annotations

import pytest
import torch

from afd_mrv2 import hookimpl
from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import make_backend
from afd_mrv2.devices.recording import RecordingBackend
from afd_mrv2.pipeline import Executor, Work, WorkItem
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import plugins_for
from tests.support.happens_before import check_happens_before

ROWS, WIDTH = 2048, 2048


class CopyLink:
    hook_api_version = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_in = {
            i: torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(i)).pin_memory() for i in range(8)
        }
        self.results: dict[WorkItem, torch.Tensor] = {}

    @hookimpl
    def on_recv(self, work: Work) -> None:
        if work.inputs.state is None:
            work.inputs.state = torch.empty(ROWS, WIDTH, device=self.device)
        work.inputs.state.copy_(self.host_in[work.item.seq % 8], non_blocking=True)

    @hookimpl
    def on_compute(self, work: Work, compute) -> None:  # type: ignore[no-untyped-def]
        if work.outputs.state is None:
            work.outputs.state = {
                "out": torch.empty(ROWS, WIDTH, device=self.device),
                "out_host": torch.empty(ROWS, WIDTH).pin_memory(),
            }
        work.outputs.state["out"].copy_(compute(work.item, work.inputs.state))

    @hookimpl
    def on_send(self, work: Work, stream) -> None:  # type: ignore[no-untyped-def]
        out = work.outputs.state["out"]  # a preallocated output buffer: no record_stream needed
        work.outputs.state["out_host"].copy_(out, non_blocking=True)
        # keep a private copy for comparison; enqueued on the send stream too
        self.results[work.item] = out.clone()


def run(pipelined: bool, backend_name: str) -> tuple[dict[WorkItem, torch.Tensor], Trace, object]:
    device = torch.accelerator.current_accelerator()
    weight = torch.randn(WIDTH, WIDTH, device=device) / WIDTH**0.5
    link = CopyLink(device)
    trace = Trace(role="ffn")
    backend = make_backend(backend_name)
    executor = Executor(
        plugins_for(link),
        backend,
        MultistreamConfig(enabled=pipelined, depth=3, trace=True),
        compute=lambda item, x: torch.tanh(x @ weight) @ weight,
        trace=trace,
    )
    with executor:
        executor.run(WorkItem(i % 4, 0, i) for i in range(24))
    torch.accelerator.synchronize()
    return link.results, trace, backend


@pytest.mark.gpu
def test_accelerator_pipelined_matches_serialized_and_overlaps() -> None:
    torch.manual_seed(0)
    serial, serial_trace, _ = run(False, "accelerator")
    torch.manual_seed(0)
    piped, piped_trace, _ = run(True, "accelerator")
    assert serial.keys() == piped.keys()
    for key in serial:
        torch.testing.assert_close(serial[key], piped[key], rtol=0, atol=0)
    metrics = piped_trace.metrics()
    assert metrics.items == 24 and metrics.hidden_comm_fraction > 0.2
    assert metrics.makespan_ns < serial_trace.metrics().makespan_ns
    assert all(s.end_ns >= s.start_ns > 0 for s in piped_trace.spans)


@pytest.mark.gpu
def test_recording_schedule_of_the_same_connector_is_proven() -> None:
    backend = RecordingBackend()
    link = CopyLink(torch.accelerator.current_accelerator())
    with Executor(plugins_for(link), backend, MultistreamConfig(enabled=True, depth=3), compute=lambda i, x: x) as ex:
        ex.run(WorkItem(0, 0, i) for i in range(12))
    check_happens_before(backend.log, host_edges=False)
