"""Stand-in for vllm.v1.worker.cpu.model_runner.CPUModelRunner (vLLM's V2 runner on CPU)."""

from __future__ import annotations

from ..gpu.model_runner import GPUModelRunner


class CPUModelRunner(GPUModelRunner):
    """Upstream adds only a warm-up method; nothing the composition touches."""
