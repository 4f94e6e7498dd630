"""Stand-in for vllm.v1.worker.gpu.model_runner.GPUModelRunner (the parts afd-mrv2 composes with).

``execute_model`` follows upstream's order at data parallelism 1: the graph manager's
``dispatch`` gives the step's descriptor; with ``num_ubatches > 1`` the step runs on
``ubatch_runner.prepare`` + ``run``, else the model is called once under the step's
forward context.  ``StepInput`` stands for vLLM's ``SchedulerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..... import EVENTS
from ....config import VllmConfig
from ....forward_context import create_forward_context, override_forward_context
from ..utils import AttentionGroup
from .cudagraph_utils import ModelCudaGraphManager
from .ubatch_utils import UBatchRunner, get_num_ubatches, maybe_build_ubatch_runner


@dataclass
class StepInput:
    """One engine step: the tokens each request schedules, and which requests are prefilling."""

    input_ids: torch.Tensor
    tokens_per_request: list[int]
    is_prefilling: list[bool]

    @classmethod
    def decode(cls, input_ids: torch.Tensor) -> StepInput:
        n = input_ids.shape[0]
        return cls(input_ids, [1] * n, [False] * n)


@dataclass
class InputBatch:
    num_reqs: int
    num_tokens: int
    num_tokens_after_padding: int
    query_start_loc_np: np.ndarray
    is_prefilling_np: np.ndarray

    def sliced(self, ubatch_slice: Any, query_start_loc_buf: torch.Tensor, seq_lens_buf: torch.Tensor) -> InputBatch:
        lo, hi = ubatch_slice.token_slice.start, ubatch_slice.token_slice.stop
        starts = np.clip(
            self.query_start_loc_np[ubatch_slice.request_slice.start : ubatch_slice.request_slice.stop + 1] - lo,
            0,
            hi - lo,
        )
        query_start_loc_buf[: len(starts)] = torch.from_numpy(starts.astype(np.int32))
        return replace(
            self,
            num_reqs=len(starts) - 1,
            num_tokens=hi - lo,
            num_tokens_after_padding=hi - lo,
            query_start_loc_np=starts,
            is_prefilling_np=self.is_prefilling_np[ubatch_slice.request_slice],
        )


@dataclass
class ExecuteModelState:
    input_batch: InputBatch
    hidden_states: Any


class ModelState:
    def prepare_attn(
        self,
        input_batch,
        cg_mode,
        block_tables,
        slot_mappings,
        attn_groups,
        kv_cache_config,
        ubatch_idx=0,
        for_capture=False,
    ) -> dict[str, Any]:
        return {
            name: group.get_metadata_builder(ubatch_idx).build(input_batch.num_tokens)
            for groups in attn_groups
            for group in groups
            for name in group.layer_names
        }


class GPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        EVENTS.append("GPUModelRunner.__init__")
        self.vllm_config = vllm_config
        self.device = device
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.ubatch_runner: UBatchRunner | None = None
        self.cudagraph_manager: ModelCudaGraphManager | None = None
        self.execute_model_state: ExecuteModelState | None = None
        self.model = None

    def load_model(self, *args, **kwargs) -> None:
        EVENTS.append("GPUModelRunner.load_model")
        self.model = kwargs.get("model")
        self.model_state = ModelState()
        self.decode_query_len = 1

    def initialize_kv_cache(
        self, kv_cache_config, is_profiling: bool = False, kv_cache_allocation_context=None
    ) -> None:
        EVENTS.append("GPUModelRunner.initialize_kv_cache")
        self.kv_cache_config = kv_cache_config
        self.attn_groups = [[AttentionGroup(["model.layers.0.self_attn.attn"])]]
        self.kernel_block_sizes = [16]
        for groups in self.attn_groups:
            for group in groups:
                group.create_metadata_builders(
                    self.vllm_config,
                    self.device,
                    16,
                    num_metadata_builders=get_num_ubatches(self.vllm_config.parallel_config),
                )
        self.ubatch_runner = maybe_build_ubatch_runner(
            self.vllm_config, self.device, self.model_state, self.attn_groups, self.kv_cache_config, self.max_num_reqs
        )
        self.cudagraph_manager = ModelCudaGraphManager(
            self.vllm_config, self.device, "NONE", self.decode_query_len, ubatch_runner=self.ubatch_runner
        )

    def execute_model(self, scheduler_output: StepInput, intermediate_tensors=None, dummy_run: bool = False, **kwargs):
        step = scheduler_output
        counts = step.tokens_per_request
        num_tokens = int(sum(counts))
        uniform = counts[0] if len(set(counts)) == 1 else None
        desc = self.cudagraph_manager.dispatch(len(counts), num_tokens, uniform, num_active_loras=0)
        input_batch = InputBatch(
            num_reqs=len(counts),
            num_tokens=num_tokens,
            num_tokens_after_padding=num_tokens,
            query_start_loc_np=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            is_prefilling_np=np.array(step.is_prefilling, dtype=bool),
        )
        model_inputs = {"input_ids": step.input_ids, "positions": torch.arange(num_tokens), "inputs_embeds": None}
        if desc.num_ubatches > 1:
            assert self.ubatch_runner is not None
            state = self.ubatch_runner.prepare(input_batch, (), None)
            hidden = self.ubatch_runner.run(self.model, model_inputs, state)
        else:
            attn = self.model_state.prepare_attn(input_batch, "NONE", (), None, self.attn_groups, self.kv_cache_config)
            with override_forward_context(create_forward_context(attn, self.vllm_config)):
                hidden = self.model(**model_inputs)
        self.execute_model_state = ExecuteModelState(input_batch, hidden)
        return None
