"""Stand-in for vllm.v1.worker.gpu.ubatch_utils (signatures as in vLLM 0.30.0 / 0.33.0)."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from ....config import VllmConfig
from .. import ubatching

#: every stream upstream's UBatchRunner.__init__ created (it hard-codes torch.cuda.Stream)
CREATED_STREAMS: list[tuple[str, object]] = []


class UBatchState(NamedTuple):
    slices: list[slice]
    forward_contexts: list[dict]


def _device_stream(device, name):
    """Stands for ``torch.cuda.Stream(device=device)``."""
    stream = ("upstream-cuda-stream", name, str(device))
    CREATED_STREAMS.append((name, stream))
    return stream


class UBatchRunner:
    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        model_state: Any,
        attn_groups: list,
        kv_cache_config: Any,
        max_num_reqs: int,
    ):
        self.vllm_config = vllm_config
        self.num_ubatches = vllm_config.parallel_config.num_ubatches
        self.device = device
        self.model_state = model_state
        self.attn_groups = attn_groups
        self.kv_cache_config = kv_cache_config
        self.max_num_reqs = max_num_reqs
        self.comm_stream = _device_stream(device, "comm")
        self.capture_stream = _device_stream(device, "capture")
        self.ready_barrier = threading.Barrier(self.num_ubatches + 1)
        self._pending_finish = None
        self.contexts_seen: list[list[ubatching.UBatchContext]] = []

    def prepare(self, input_batch, block_tables, slot_mappings, cg_mode="NONE", for_capture=False) -> UBatchState:
        n = input_batch.num_tokens
        bounds = [n * i // self.num_ubatches for i in range(self.num_ubatches + 1)]
        slices = [slice(bounds[i], bounds[i + 1]) for i in range(self.num_ubatches)]
        return UBatchState(slices, [{"ubatch": i} for i in range(self.num_ubatches)])

    def run(self, model, model_inputs, ubatch_state):
        finish = self.begin_capturable_run(model, model_inputs, ubatch_state)
        return finish()

    def begin_capturable_run(self, model, model_inputs, ubatch_state, for_capture=False):
        compute_stream = self.capture_stream if for_capture else "current-compute-stream"
        contexts = ubatching.make_ubatch_contexts(
            num_micro_batches=self.num_ubatches,
            comm_stream=self.comm_stream,
            compute_stream=compute_stream,
            forward_contexts=ubatch_state.forward_contexts,
            ready_barrier=self.ready_barrier,
        )
        self.contexts_seen.append(contexts)
        outputs: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        def run_ubatch(context, inputs):
            try:
                with context:
                    outputs[context.id] = model(**inputs)
            except BaseException as exc:  # noqa: BLE001 - reported by finish
                errors[context.id] = exc

        threads = []
        for context, token_slice in zip(contexts, ubatch_state.slices, strict=True):
            inputs = {k: v[token_slice] for k, v in model_inputs.items()}
            thread = threading.Thread(target=run_ubatch, args=(context, inputs))
            threads.append(thread)
            thread.start()
        self.ready_barrier.wait()

        def finish():
            contexts[0].cpu_wait_event.set()
            for thread in threads:
                thread.join()
            self._pending_finish = None
            if errors:
                raise RuntimeError(f"Microbatch {next(iter(errors))} failed") from next(iter(errors.values()))
            return torch.cat([outputs[i] for i in range(self.num_ubatches)])

        self._pending_finish = finish
        return finish

    def abort_pending_run(self):
        if self._pending_finish is not None:
            self._pending_finish()


def maybe_build_ubatch_runner(
    vllm_config: VllmConfig,
    device: torch.device,
    model_state: Any,
    attn_groups: list,
    kv_cache_config: Any,
    max_num_reqs: int,
) -> UBatchRunner | None:
    parallel_config = vllm_config.parallel_config
    if not parallel_config.use_ubatching or parallel_config.data_parallel_size <= 1:
        return None
    return UBatchRunner(vllm_config, device, model_state, attn_groups, kv_cache_config, max_num_reqs)
