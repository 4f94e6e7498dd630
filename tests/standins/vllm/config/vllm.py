"""Stand-in for vllm.config.vllm: only the fields afd-mrv2 reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    use_ubatching: bool = True
    data_parallel_size: int = 2
    num_ubatches: int = 2


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 8


@dataclass
class VllmConfig:
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    additional_config: dict = field(default_factory=dict)
    use_v2_model_runner: bool = True  # a property upstream (VLLM_USE_V2_MODEL_RUNNER)
