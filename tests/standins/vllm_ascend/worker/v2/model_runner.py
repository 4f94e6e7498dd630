"""Stand-in for vllm_ascend.worker.v2.model_runner.NPUModelRunner (vllm-ascend main, 2026-08)."""

from __future__ import annotations

from .... import EVENTS  # noqa: F401 - the same events list
from ....vllm.v1.worker.gpu.model_runner import GPUModelRunner


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)

    def initialize_kv_cache(self, kv_cache_config) -> None:
        super().initialize_kv_cache(kv_cache_config)
