"""Stand-in for vllm.config.vllm: only the fields afd-mrv2 reads (defaults as a DP-1 engine without DBO flags)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    use_ubatching: bool = False  # a property upstream (enable_dbo / ubatch_size > 1)
    data_parallel_size: int = 1
    num_ubatches: int = 0  # upstream: 0 without vLLM's DBO flags
    cp_kv_cache_interleave_size: int = 1
    # the support matrix reads these too (afd_mrv2.mrv2.deployment)
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    use_sequence_parallel_moe: bool = False  # a property upstream
    # an Attention group's process rank (afd_mrv2.mrv2.deployment.process_rank) and admission's refusals
    data_parallel_rank: int = 0
    rank: int = 0
    enable_elastic_ep: bool = False


@dataclass
class ModelConfig:
    enforce_eager: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64


@dataclass
class VllmConfig:
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    additional_config: dict = field(default_factory=dict)
    use_v2_model_runner: bool = True  # a property upstream (VLLM_USE_V2_MODEL_RUNNER)
    lora_config: object = None
