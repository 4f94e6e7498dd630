"""Stand-in for vllm.v1.worker.cpu_worker.CPUWorker: builds its runner inline in init_device.

Upstream's ``Worker.__init__`` assigns ``use_v2_model_runner`` and builds no runner;
``CPUWorker.init_device`` (device, threads, distributed set-up, then the runner)
never calls ``_make_model_runner``.  Reduced here to the runner choice.
"""

from __future__ import annotations

from .cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
from .gpu_worker import Worker


class CPUModelRunner:
    """Stands for the V1 CPU runner (``vllm.v1.worker.cpu_model_runner.CPUModelRunner``)."""

    def __init__(self, vllm_config, device) -> None:
        self.vllm_config = vllm_config
        self.device = device


class CPUWorker(Worker):
    def __init__(self, vllm_config, device):  # no runner yet (upstream: Worker.__init__ builds none)
        self.vllm_config = vllm_config
        self.device = device
        self.use_v2_model_runner = vllm_config.use_v2_model_runner
        self.model_runner = None

    def init_device(self):
        if self.use_v2_model_runner:
            self.model_runner = CPUModelRunnerV2(self.vllm_config, self.device)
        else:
            self.model_runner = CPUModelRunner(self.vllm_config, "cpu")
