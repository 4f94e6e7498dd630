"""Stand-in for vllm.v1.worker.gpu.ubatch_utils (signatures as in vLLM 0.32.0 / 0.33.0).

Our own reduced code with upstream's contract for what afd-mrv2 reuses or replaces:

* ``UBatchRunner.__init__`` fails without CUDA/ROCm, as upstream's does (its SM-control
  context asserts the platform): afd-mrv2's micro-batch runner must never call it;
* ``prepare`` splits the batch at ``num_tokens_after_padding // num_ubatches``, builds
  each micro-batch's attention metadata with ``model_state.prepare_attn(...,
  ubatch_idx=i)`` (a group with one builder asserts for micro-batch 1) and its forward
  context with ``self._make_forward_contexts``, whose upstream body asserts DP > 1
  (``DPMetadata.make``);
* ``run`` = ``begin_capturable_run`` + its ``finish``; upstream's launcher selects the
  device by index in each thread, which on CPU kills the thread before its barrier:
  here it raises instead of hanging;
* ``slice_model_inputs`` / ``merge_ubatch_outputs`` narrow and concatenate per token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..... import EVENTS
from .... import forward_context


@dataclass
class UBatchSlice:
    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


class UBatchState(NamedTuple):
    slices: list[UBatchSlice]
    forward_contexts: list[Any]


def get_num_ubatches(parallel_config) -> int:
    return parallel_config.num_ubatches if parallel_config.use_ubatching else 1


def create_ubatch_slices(input_batch, num_ubatches: int) -> list[UBatchSlice]:
    total = input_batch.num_tokens_after_padding
    point = total // num_ubatches
    bounds = [point * i for i in range(num_ubatches)] + [total]
    starts = np.asarray(input_batch.query_start_loc_np)
    slices = []
    for lo, hi in itertools.pairwise(bounds):
        first = int(np.searchsorted(starts, lo, side="right") - 1)
        stop = int(np.searchsorted(starts, hi, side="left"))
        slices.append(UBatchSlice(slice(first, max(stop, first + 1)), slice(lo, hi)))
    return slices


def slice_model_inputs(model_inputs: dict[str, Any], token_slice: slice) -> dict[str, Any]:
    sliced = dict(model_inputs)
    for key in ("input_ids", "inputs_embeds", "positions"):
        if model_inputs.get(key) is not None:
            sliced[key] = model_inputs[key][token_slice]
    return sliced


def merge_ubatch_outputs(outputs: list[Any]) -> Any:
    return torch.cat(outputs, dim=0)


class UBatchRunner:
    def __init__(
        self,
        vllm_config,
        device: torch.device,
        model_state: Any,
        attn_groups: list,
        kv_cache_config: Any,
        max_num_reqs: int,
    ):
        EVENTS.append("UBatchRunner.__init__")
        raise AssertionError("SM/CU control is supported on CUDA and ROCm platforms")

    def prepare(self, input_batch, block_tables, slot_mappings, cg_mode="NONE", for_capture=False) -> UBatchState:
        slices = create_ubatch_slices(input_batch, self.num_ubatches)
        attn_metadata, slot_maps, is_padding = [], [], []
        for i, ubatch_slice in enumerate(slices):
            sub = input_batch.sliced(ubatch_slice, self.ubatch_query_start_loc[i], self.ubatch_seq_lens[i])
            attn_metadata.append(
                self.model_state.prepare_attn(
                    sub,
                    cg_mode,
                    block_tables,
                    slot_mappings,
                    self.attn_groups,
                    self.kv_cache_config,
                    ubatch_idx=i,
                    for_capture=for_capture,
                )
            )
            slot_maps.append({})
            is_padding.append(None)
        return UBatchState(slices, self._make_forward_contexts(slices, attn_metadata, slot_maps, is_padding))

    def _make_forward_contexts(self, ubatch_slices, attn_metadata, slot_mappings_by_layer, is_padding):
        contexts = []
        for i, ubatch_slice in enumerate(ubatch_slices):
            dp = forward_context.DPMetadata.make(self.parallel_config, ubatch_slice.num_tokens, None)
            contexts.append(
                forward_context.create_forward_context(
                    attn_metadata[i], self.vllm_config, dp_metadata=dp, slot_mapping=slot_mappings_by_layer[i]
                )
            )
        return contexts

    def run(self, model, model_inputs, ubatch_state):
        finish = self.begin_capturable_run(model, model_inputs, ubatch_state)
        return finish()

    def begin_capturable_run(self, model, model_inputs, ubatch_state, for_capture=False):
        raise ValueError(
            "torch.accelerator.set_device_index(None): upstream's launcher selects the device by index, which a "
            "CPU device does not have (the micro-batch thread dies before its barrier and the step hangs)"
        )

    def abort_pending_run(self):
        if self._pending_finish is not None:
            self._pending_finish()


def maybe_build_ubatch_runner(
    vllm_config, device: torch.device, model_state: Any, attn_groups: list, kv_cache_config: Any, max_num_reqs: int
) -> UBatchRunner | None:
    parallel_config = vllm_config.parallel_config
    if not parallel_config.use_ubatching or parallel_config.data_parallel_size <= 1:
        return None
    return UBatchRunner(vllm_config, device, model_state, attn_groups, kv_cache_config, max_num_reqs)
