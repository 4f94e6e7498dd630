"""Shared set-up for the MRV2 composition tests: stand-in upstream, an accepting gate, a toy model."""

from __future__ import annotations

import torch

from afd_mrv2.compat import Runtime, decide
from afd_mrv2.mrv2.upstream import Upstream
from tests.standins.vllm.v1.worker import ubatching
from tests.standins.vllm.v1.worker.gpu import model_runner as standin_runner
from tests.standins.vllm.v1.worker.gpu import ubatch_utils
from tests.standins.vllm_ascend.worker.v2 import model_runner as standin_npu

CUDA = Upstream(
    "cuda",
    standin_runner.GPUModelRunner,
    ubatch_utils.UBatchRunner,
    ubatching.dbo_current_ubatch_id,
    ubatching.dbo_enabled,
)
ASCEND = Upstream(
    "ascend",
    standin_npu.NPUModelRunner,
    ubatch_utils.UBatchRunner,
    ubatching.dbo_current_ubatch_id,
    ubatching.dbo_enabled,
)
RUNTIME_0_33 = Runtime(python="3.11.9", vllm="0.33.0", vllm_ascend=None, torch="2.14.0", torch_npu=None, cann=None)


def accept_0_33(required: tuple[str, ...]):
    """The compat gate as it decides on a CUDA vLLM 0.33.0 stack."""
    return decide(RUNTIME_0_33, require=required, env={})


def afd_section(*, multistream_roles=("attention",), enabled=True, backend="recording", observers=(), role="attention"):
    return {
        "connector": "simlink",
        "role": role,
        "observers": list(observers),
        "connector_extra_config": {"latency_us": 0, "bandwidth_gbps": 0},
        "multistream": {"enabled": enabled, "roles": list(multistream_roles), "backend": backend, "depth": 2},
    }


class ToyModel:
    """Each layer starts its AFD transfer, yields to the sibling microbatch, then finishes it
    (vLLM's dual-batch overlap: dispatch, yield, combine)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.exchange = None

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = input_ids.to(torch.float32)
        for layer in range(self.num_layers):
            ticket = self.exchange.start(layer, hidden + 1.0)
            ubatching.dbo_yield()
            hidden = self.exchange.finish(ticket)
        return hidden


def expected(input_ids: torch.Tensor, num_layers: int) -> torch.Tensor:
    hidden = input_ids.to(torch.float32)
    for layer in range(num_layers):
        hidden = (hidden + 1.0) * 2.0 + layer  # the test runners' afd_compute
    return hidden
