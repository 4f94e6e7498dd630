"""Stand-in for vllm.config."""

from .vllm import ParallelConfig, VllmConfig

__all__ = ["ParallelConfig", "VllmConfig"]
