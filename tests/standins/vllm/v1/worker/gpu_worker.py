"""Stand-in for vllm.v1.worker.gpu_worker.Worker (vLLM 0.33.0 has _make_model_runner)."""

from __future__ import annotations

from .gpu.model_runner import GPUModelRunner


class Worker:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = device
        self.model_runner = self._make_model_runner()

    def _make_model_runner(self) -> GPUModelRunner:
        return GPUModelRunner(self.vllm_config, self.device)
