"""The FFN-side loop: driven by the executor, no per-step drain, no device-wide synchronize."""

from __future__ import annotations

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.mrv2.ffn.loop import FfnLoop
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.plugins import FfnContext, load_plugins
from tests.support.happens_before import check_happens_before


def _loop(backend: str, latency_us: float, *, layers=3, stages=2):
    config = parse_afd_config(
        {
            "connector": "simlink",
            "role": "ffn",
            "connector_extra_config": {"latency_us": latency_us, "bandwidth_gbps": 0},
            "multistream": {"enabled": True, "depth": 2, "backend": backend},
        }
    )
    outputs = {}
    context = FfnContext(
        config=config,
        source=lambda item: torch.full((4,), float(item.seq)),
        sink=lambda item, out: outputs.__setitem__(item, out),
    )
    plugins = load_plugins(context)
    dev = make_backend(backend)
    executor = Executor(plugins, dev, config.multistream, compute=lambda item, x: x * 3.0, role="ffn")
    return FfnLoop(executor, num_layers=layers, num_stages=stages), dev, outputs


@pytest.fixture
def no_device_synchronize(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("device-wide synchronize called")

    monkeypatch.setattr(torch.accelerator, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)


def test_recording_three_steps_prove_the_edges(no_device_synchronize) -> None:
    loop, dev, outputs = _loop("recording", 0)
    loop.run(3)
    assert loop.close().clean
    items = sorted(outputs, key=lambda i: i.seq)
    assert [(i.layer_idx, i.stage_idx) for i in items] == [(layer, s) for layer in range(3) for s in range(2)] * 3
    assert all(torch.equal(outputs[i], torch.full((4,), 3.0 * i.seq)) for i in items)
    check_happens_before(dev.log, host_edges=False)
    # host waits: only slot reuse (one per item beyond the depth) and the final drain in close
    syncs = [op for op in dev.log if op.kind == "sync"]
    assert len(syncs) <= len(items) + 2


def test_step_returns_with_work_in_flight(no_device_synchronize) -> None:
    """Host backend, 20 ms transfers: step() returns before its last items completed (no per-step drain)."""
    loop, _dev, outputs = _loop("host", 20_000, layers=1, stages=2)
    loop.step()
    in_flight = loop.executor.in_flight
    # the proof is what is still in flight when step() returned, not a wall-clock bound (load-dependent)
    assert in_flight, "step() drained its work: the FFN loop must not wait at step end"
    loop.step()
    assert loop.close(5.0).clean
    assert len(outputs) == 4


def test_bad_shape_is_refused() -> None:
    loop, *_ = _loop("recording", 0)
    with pytest.raises(ValueError, match="num_layers and num_stages must be >= 1"):
        FfnLoop(loop.executor, num_layers=0, num_stages=2)


def test_submitted_counts_the_items_the_executor_accepted_even_when_a_step_ends_half_way() -> None:
    """A pipelined executor fails a later submit (an earlier item's recv failed); the items it
    accepted before that are what the FFN report's served count starts from."""
    from afd_mrv2.errors import PipelineError

    class FailsOnFourthSubmit:
        def __init__(self) -> None:
            self.accepted: list[int] = []

        def submit(self, item) -> None:
            if len(self.accepted) == 3:  # the second item of the second step
                raise PipelineError("on_recv failed for an earlier item")
            self.accepted.append(item.seq)

    executor = FailsOnFourthSubmit()
    loop = FfnLoop(executor, num_layers=2, num_stages=1)  # type: ignore[arg-type]
    loop.step()
    with pytest.raises(PipelineError):
        loop.step()
    assert executor.accepted == [0, 1, 2] and loop.submitted == 3 and loop.steps == 1
