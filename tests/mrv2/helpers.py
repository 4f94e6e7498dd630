"""Shared set-up for the MRV2 composition tests: stand-in upstream, an accepting gate, a toy MoE model.

The toy model's MoE layers call the real MoE seam (:meth:`RemoteExperts.exchange`), whose
round trips go over a real gloo group to a real ``serve_ffn`` thread (the FFN role of
these tests); its "attention" is a small matmul per layer, optionally slowed by a sleep
(which, like torch's kernels, releases the GIL) so that overlap can be measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from afd_mrv2.compat import Runtime, decide
from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.attention.handoff import Handoff
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.mrv2.upstream import UBatchApi, Upstream
from afd_mrv2.procs import free_port
from tests.mrv2.test_vllm_path import LAYERS, SHAPE, _reference, afd, start_ffn
from tests.standins.vllm import forward_context
from tests.standins.vllm.utils import torch_utils
from tests.standins.vllm.v1.worker import ubatching
from tests.standins.vllm.v1.worker.cpu import model_runner as standin_cpu
from tests.standins.vllm.v1.worker.gpu import cudagraph_utils, ubatch_utils
from tests.standins.vllm.v1.worker.gpu import model_runner as standin_runner
from tests.standins.vllm_ascend.worker.v2 import model_runner as standin_npu

HANDOFF = Handoff(active=ubatching.dbo_enabled, current=ubatching.dbo_current_ubatch_id, hand_over=ubatching.dbo_yield)
API = UBatchApi(
    base=ubatch_utils.UBatchRunner,
    make_ubatch_contexts=ubatching.make_ubatch_contexts,
    slice_model_inputs=ubatch_utils.slice_model_inputs,
    merge_ubatch_outputs=ubatch_utils.merge_ubatch_outputs,
    create_forward_context=forward_context.create_forward_context,
    override_forward_context=forward_context.override_forward_context,
    current_stream=torch_utils.current_stream,
    graph_manager=cudagraph_utils.ModelCudaGraphManager,
    handoff=HANDOFF,
)
CUDA = Upstream("cuda", standin_runner.GPUModelRunner, API)
CPU = Upstream("cpu", standin_cpu.CPUModelRunner, API)
ASCEND = Upstream("ascend", standin_npu.NPUModelRunner, API)
RUNTIME_0_33 = Runtime(python="3.11.9", vllm="0.33.0", vllm_ascend=None, torch="2.14.0", torch_npu=None, cann=None)
VOCAB = 64


def accept_0_33(required: tuple[str, ...]):
    """The compat gate as it decides on a CUDA vLLM 0.33.0 stack."""
    return decide(RUNTIME_0_33, require=required, env={})


def attention_afd(port: int, ubatches: int = 2, *, threshold: int = 2, **extra: Any) -> dict[str, Any]:
    """The Attention role's afd section: micro-batching with both token thresholds at ``threshold``."""
    ubatch = {"num_ubatches": ubatches, "decode_token_threshold": threshold, "prefill_token_threshold": threshold}
    return afd("attention", port, ubatch=ubatch, **extra)


class ToyMoeModel(torch.nn.Module):
    """Embedding, then per MoE layer: "attention" (a matmul, plus ``compute_s`` of sleep), the router
    (top-k of a linear map, softmax weights) and the routed experts through ``remote.exchange``.

    ``fail_at = (micro-batch, ordinal)`` raises in that micro-batch's attention of that layer (a test
    injection; micro-batch 0 is also an unsplit step's).
    """

    def __init__(
        self,
        remote: RemoteExperts,
        *,
        compute_s: float = 0.0,
        ubatch_id: Callable[[], int] = ubatching.dbo_current_ubatch_id,
        get_context: Callable[[], Any] = forward_context.get_forward_context,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.remote = remote
        self.compute_s = compute_s
        self.ubatch_id = ubatch_id
        self.get_context = get_context
        self.fail_at: tuple[int, int] | None = None
        self.embed = torch.randn(VOCAB, SHAPE.hidden_size, generator=gen)
        self.attn = torch.randn(len(LAYERS), SHAPE.hidden_size, SHAPE.hidden_size, generator=gen) * 0.3
        self.router = torch.randn(len(LAYERS), SHAPE.hidden_size, SHAPE.num_experts, generator=gen)
        self.contexts: list[Any] = []  # the forward context each call saw at its first layer

    def forward(self, input_ids: torch.Tensor, positions: Any = None, inputs_embeds: Any = None) -> torch.Tensor:
        self.contexts.append(self.get_context())
        return self.run(input_ids, self.remote.exchange)

    def run(self, input_ids: torch.Tensor, experts: Any) -> torch.Tensor:
        hidden = self.embed[input_ids.long()]
        for ordinal, layer in enumerate(LAYERS):
            if self.fail_at == (self.ubatch_id(), ordinal):
                raise RuntimeError(f"injected failure in layer {ordinal}")
            if self.compute_s:
                time.sleep(self.compute_s)
            hidden = hidden + torch.tanh(hidden @ self.attn[ordinal])
            weights, ids = torch.softmax(hidden @ self.router[ordinal], dim=-1).topk(SHAPE.top_k, dim=-1)
            hidden = hidden + experts(layer, hidden, weights, ids.to(torch.int32))
        return hidden

    def reference(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The same forward with the experts computed here (no AFD, no micro-batches)."""
        ordinals = {layer: i for i, layer in enumerate(LAYERS)}
        return self.run(input_ids, lambda layer, x, w, ids: _reference(ordinals[layer], x, w, ids))


class FfnPair:
    """A real ``serve_ffn`` thread and this test's Attention side (:class:`RemoteExperts`) on a fresh port.

    ``ffn_delay_s`` slows every expert computation of the FFN (a slow link or a busy FFN);
    ``ffn_fails_after`` makes the FFN's expert computation raise after that many calls (the FFN
    rank then stops serving and tells the Attention side why, as a failing FFN process does);
    ``handoff``: the micro-batch hand-off the Attention side uses (the stand-in's by default,
    vLLM's real one in tests/vllm).
    """

    def __init__(
        self,
        *,
        ubatches: int = 2,
        threshold: int = 2,
        ffn_delay_s: float = 0.0,
        ffn_fails_after: int | None = None,
        handoff: Handoff = HANDOFF,
        **extra: Any,
    ) -> None:
        self.port = free_port()
        self.done: dict[str, Any] = {}
        calls = [0]

        def expert(ordinal: int, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if ffn_fails_after is not None and calls[0] > ffn_fails_after:
                raise RuntimeError("the FFN's experts failed (test)")
            if ffn_delay_s:
                time.sleep(ffn_delay_s)
            return _reference(ordinal, x, w, ids)

        experts = [lambda x, w, ids, ordinal=ordinal: expert(ordinal, x, w, ids) for ordinal in range(len(LAYERS))]
        self.thread: threading.Thread = start_ffn(self.done, afd("ffn", self.port), experts)
        self.section = attention_afd(self.port, ubatches, threshold=threshold, **extra)
        self.remote = RemoteExperts(parse_afd_config(self.section), max_tokens=32, handoff=handoff)
        for layer in LAYERS:
            self.remote.add_layer(layer, SHAPE)

    def close(self) -> dict[str, Any]:
        self.remote.close()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the FFN thread did not end"
        return self.done
