"""Stand-in for vllm.forward_context: the process-wide forward context (a module global, as upstream).

``DPMetadata.make`` asserts data parallelism > 1, as upstream does: per-micro-batch
forward contexts built with it cannot exist at DP 1.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

_forward_context: dict[str, Any] | None = None


class DPMetadata:
    @staticmethod
    def make(parallel_config, num_tokens, num_tokens_across_dp_cpu):
        assert parallel_config.data_parallel_size > 1 or parallel_config.use_sequence_parallel_moe
        return DPMetadata()


def create_forward_context(
    attn_metadata,
    vllm_config,
    dp_metadata=None,
    cudagraph_runtime_mode=None,
    batch_descriptor=None,
    ubatch_slices=None,
    slot_mapping=None,
    additional_kwargs=None,
    skip_compiled=False,
    is_padding=None,
):
    return {"attn_metadata": attn_metadata, "dp_metadata": dp_metadata, "slot_mapping": slot_mapping or {}}


@contextmanager
def override_forward_context(forward_context):
    global _forward_context
    previous = _forward_context
    _forward_context = forward_context
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context():
    assert _forward_context is not None, "no forward context is set"
    return _forward_context
