"""Stand-in for vllm.v1.worker.gpu.model_runner.GPUModelRunner (the parts afd-mrv2 composes with)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..... import EVENTS
from ....config import VllmConfig
from .ubatch_utils import UBatchRunner, maybe_build_ubatch_runner


@dataclass
class InputBatch:
    num_tokens: int


class GPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        EVENTS.append("GPUModelRunner.__init__")
        self.vllm_config = vllm_config
        self.device = device
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.ubatch_runner: UBatchRunner | None = None
        self.model = None

    def load_model(self, *args, **kwargs) -> None:
        EVENTS.append("GPUModelRunner.load_model")
        self.model_state = ("model-state", id(self))
        self.model = kwargs.get("model")

    def initialize_kv_cache(
        self, kv_cache_config, is_profiling: bool = False, kv_cache_allocation_context=None
    ) -> None:
        EVENTS.append("GPUModelRunner.initialize_kv_cache")
        self.kv_cache_config = kv_cache_config
        (self.attn_groups, _support) = ([["attn-group"]], None)
        self.ubatch_runner = maybe_build_ubatch_runner(
            self.vllm_config, self.device, self.model_state, self.attn_groups, self.kv_cache_config, self.max_num_reqs
        )

    def execute_model(self, input_batch: InputBatch, model_inputs: dict) -> torch.Tensor:
        """Upstream's ubatched forward: prepare, then run on the runner's ubatch runner."""
        if self.ubatch_runner is None:
            return self.model(**model_inputs)
        state = self.ubatch_runner.prepare(input_batch, (), None)
        return self.ubatch_runner.run(self.model, model_inputs, state)
