"""Sizes and seeds of the tiny reference MoE model and of the prefill batches.

Everything is derived from these frozen dataclasses and a seed, so every process
of a run (and the single-process ground truth) builds bit-identical weights and
inputs without downloading or exchanging anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from afd_mrv2.topology import Topology

ROUTINGS = ("balanced", "skewed", "idle-rank")


@dataclass(frozen=True)
class ModelSpec:
    """A DeepSeek-V2-style MoE decoder, scaled down.

    Attention side per layer: RMSNorm, causal multi-head self-attention, residual,
    RMSNorm, router gate (softmax over ``num_experts``, top-``top_k``).  FFN side:
    ``top_k`` of ``num_experts`` routed SwiGLU experts (``expert_size`` wide)
    weighted by the gate, plus one always-on shared SwiGLU expert
    (``shared_size`` wide).  No MLA and no rotary embedding: the attention is only
    there to give each layer real, sequence-dependent work.

    Routing controls (for the skew and idle-rank experiments): ``hot_expert`` gets
    ``hot_bias`` added to its gate logit; ``blocked_experts`` are never selected.
    """

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 1024
    shared_size: int = 1024
    seed: int = 0
    hot_expert: int | None = None
    hot_bias: float = 4.0
    blocked_experts: tuple[int, ...] = ()
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_experts",
            "top_k",
            "expert_size",
            "shared_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        if any(not 0 <= e < self.num_experts for e in self.blocked_experts):
            raise ValueError(f"model.blocked_experts must be in 0..{self.num_experts - 1}, got {self.blocked_experts}")
        if self.num_experts - len(set(self.blocked_experts)) < self.top_k:
            raise ValueError(
                f"model.top_k ({self.top_k}) exceeds the {self.num_experts - len(set(self.blocked_experts))} selectable experts"
            )
        if self.hot_expert is not None and not 0 <= self.hot_expert < self.num_experts:
            raise ValueError(f"model.hot_expert must be in 0..{self.num_experts - 1}, got {self.hot_expert}")


@dataclass(frozen=True)
class BatchSpec:
    """Prefill batches of one attention rank: ``stages`` micro-batches of whole requests.

    Each stage holds ``requests_per_stage`` requests of ``min_len..max_len`` tokens
    (request split: attention never crosses a stage boundary).
    """

    stages: int = 4
    requests_per_stage: int = 2
    min_len: int = 16
    max_len: int = 32
    seed: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.requests_per_stage < 1:
            raise ValueError("batch.stages and batch.requests_per_stage must be >= 1")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"batch lengths need 1 <= min_len <= max_len, got {self.min_len}..{self.max_len}")

    @property
    def max_tokens(self) -> int:
        """Capacity of one stage (the transport's per-stage buffer size)."""
        return self.requests_per_stage * self.max_len


def with_routing(spec: ModelSpec, routing: str, topology: Topology) -> ModelSpec:
    """Apply a named routing scenario.

    ``balanced``: the plain gate.  ``skewed``: expert 0 is hot (its logit gets
    ``hot_bias``), so well over 70% of tokens select it.  ``idle-rank``: every
    expert of the last FFN rank is blocked, so that rank receives zero tokens
    (needs 2+ FFN ranks).
    """
    if routing == "balanced":
        return replace(spec, hot_expert=None, blocked_experts=())
    if routing == "skewed":
        return replace(spec, hot_expert=0, blocked_experts=())
    if routing == "idle-rank":
        if topology.num_ffn < 2:
            raise ValueError("routing 'idle-rank' needs at least 2 FFN ranks (one of them is left without tokens)")
        return replace(spec, hot_expert=None, blocked_experts=tuple(topology.experts_of(topology.num_ffn - 1)))
    raise ValueError(f"unknown routing {routing!r}; accepted: {', '.join(ROUTINGS)}")
