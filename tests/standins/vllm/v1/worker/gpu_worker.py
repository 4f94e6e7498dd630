"""Stand-in for vllm.v1.worker.gpu_worker.Worker (vLLM 0.33.0 has _make_model_runner)."""

from __future__ import annotations

from .gpu.model_runner import GPUModelRunner


class V1ModelRunner:
    """Stands for the V1 runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``)."""

    def __init__(self, vllm_config, device) -> None:
        self.vllm_config = vllm_config
        self.device = device


class Worker:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = device
        self.use_v2_model_runner = vllm_config.use_v2_model_runner
        self.model_runner = self._make_model_runner()

    def _make_model_runner(self):
        if self.use_v2_model_runner:
            return GPUModelRunner(self.vllm_config, self.device)
        return V1ModelRunner(self.vllm_config, self.device)
