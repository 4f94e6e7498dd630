"""The CUDA worker builds afd-mrv2's Attention runner and micro-batch runner over the real CUDA vLLM.

Needs a CUDA vLLM and a GPU (markers ``gpu`` and ``vllm_runtime``; deselected by default
and FAILING when selected without them, see tests/conftest.py).  The same composition
runs for real on the CPU test vehicle in tests/vllm; here the CUDA shapes: the worker's
``_make_model_runner`` seam, the V2 ``GPUModelRunner`` base, upstream's ``UBatchRunner``
base, and the accelerator backend's streams and thread device selection.
"""

from __future__ import annotations

import threading

import pytest

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.gpu]


def test_cuda_worker_builds_the_same_attention_runner_and_micro_batch_runner(tmp_path) -> None:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner
    from vllm.v1.worker.gpu_worker import Worker

    from afd_mrv2.checkpoints.archs import ModelShape
    from afd_mrv2.checkpoints.make import make_checkpoint
    from afd_mrv2.compat import check_runtime
    from afd_mrv2.devices import make_backend
    from afd_mrv2.mrv2.attention import worker as worker_module
    from afd_mrv2.mrv2.attention.runner import AfdAttentionRunnerMixin, attention_runner_class
    from afd_mrv2.mrv2.attention.ubatch_runner import UBATCH_STREAM_ROLES, AfdUBatchRunnerMixin, afd_ubatch_runner_class
    from afd_mrv2.mrv2.upstream import load_upstream

    decision = check_runtime(("moe_seam", "mrv2", "ubatch_runner", "worker_runner_factory"))
    assert decision.accepted and decision.platform == "cuda", decision.message()
    worker_cls = worker_module.AfdWorker
    assert issubclass(worker_cls, Worker) and "_make_model_runner" in vars(worker_cls)
    upstream = load_upstream("cuda")
    runner_cls = attention_runner_class(upstream)
    assert issubclass(runner_cls, GPUModelRunner) and issubclass(runner_cls, AfdAttentionRunnerMixin)
    ubatch_cls = afd_ubatch_runner_class(upstream.ubatch)
    assert issubclass(ubatch_cls, UBatchRunner) and issubclass(ubatch_cls, AfdUBatchRunnerMixin)

    # the runner's configuration checks on a real VllmConfig of a micro-batched Attention engine
    model = make_checkpoint(str(tmp_path / "model"), ModelShape("mixtral")).folder
    afd = {
        "connector": "torch_p2p",
        "role": "attention",
        "compute_gate_on_attention": True,
        "ubatch": {"num_ubatches": 2},
    }
    config = EngineArgs(model=model, enforce_eager=True, additional_config={"afd": afd}).create_engine_config()
    from afd_mrv2.mrv2.deployment import check_vllm_deployment
    from afd_mrv2.validation import validate

    section = validate(config.additional_config, v2_runner=True)
    assert section is not None and section.ubatch.num_ubatches == 2
    check_vllm_deployment(section, config, triton=True)

    # the accelerator backend: CUDA streams for the micro-batch runner, the device chosen per thread
    backend = make_backend("accelerator")
    streams = {role: backend.new_stream(role) for role in UBATCH_STREAM_ROLES}
    assert all(isinstance(s.native, torch.Stream) for s in streams.values())
    seen: list[int] = []
    thread = threading.Thread(
        target=lambda: (backend.bind_thread(torch.device("cuda", 0)), seen.append(torch.cuda.current_device()))
    )
    thread.start()
    thread.join(30)
    assert seen == [0]
