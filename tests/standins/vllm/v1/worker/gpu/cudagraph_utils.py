"""Stand-in for vllm.v1.worker.gpu.cudagraph_utils: the manager whose dispatch gives a step's descriptor.

Eager only (no graphs are ever captured here): ``dispatch`` returns an eager
descriptor carrying the ``num_ubatches`` it was asked for, as upstream does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: str
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1


class CudaGraphManager:
    def __init__(
        self,
        vllm_config,
        device,
        cudagraph_mode,
        decode_query_len,
        lora_capture_cases=None,
        varlen_decode=False,
        ubatch_runner=None,
    ):
        self.vllm_config = vllm_config
        self.device = device
        self.cudagraph_mode = cudagraph_mode
        self.decode_query_len = decode_query_len
        self.lora_capture_cases = lora_capture_cases or [0]
        self.varlen_decode = varlen_decode
        self.ubatch_runner = ubatch_runner

    def dispatch(
        self, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None, num_ubatches=1
    ) -> BatchExecutionDescriptor:
        return BatchExecutionDescriptor(
            cg_mode="NONE",
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_active_loras=num_active_loras,
            num_ubatches=num_ubatches,
        )


class ModelCudaGraphManager(CudaGraphManager):
    def __init__(
        self,
        vllm_config,
        device,
        cudagraph_mode,
        decode_query_len,
        lora_capture_cases=None,
        varlen_decode=False,
        ubatch_runner=None,
    ):
        super().__init__(
            vllm_config,
            device,
            cudagraph_mode,
            decode_query_len,
            lora_capture_cases=lora_capture_cases,
            varlen_decode=varlen_decode,
            ubatch_runner=ubatch_runner,
        )
