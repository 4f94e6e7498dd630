"""`make-model --kernels vllm` against the real vLLM CPU kernels (``pytest -m vllm_runtime``).

Selected on a machine without vLLM these FAIL (tests/conftest.py), never skip.
"""

from __future__ import annotations

import pytest

from afd_mrv2.checkpoints import bench_vllm
from afd_mrv2.checkpoints.archs import ARCHS, ModelShape
from afd_mrv2.checkpoints.bench import BenchLoad, measure_layer_compute

pytestmark = pytest.mark.vllm_runtime


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_kernels_measure_the_same_structure(arch: str) -> None:
    assert bench_vllm.available() is None, f"vLLM's CPU kernels are not usable here: {bench_vllm.available()}"
    shape = ModelShape(arch, layers=2, hidden=128, experts=4, top_k=2, intermediate_size=64)
    measured = measure_layer_compute(shape, BenchLoad(seqs=8, prompt_min=4, prompt_max=6, decoded=3), kernels="vllm")
    attention = "torch" if arch == "deepseek_v2" else "vllm"  # MLA attention is always the torch emulation
    assert measured.kernels == {"attention": attention, "ffn": "vllm"}
    assert measured.attention.full_ms > 0 and measured.ffn.half_ms > 0
    assert (measured.tokens, measured.half_tokens) == (8, 4)
