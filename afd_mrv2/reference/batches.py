"""Deterministic prefill batches: token ids and request lengths from a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_mrv2.reference.spec import BatchSpec


@dataclass(frozen=True)
class StageBatch:
    """One micro-batch (stage) of one attention rank: whole requests back to back."""

    tokens: torch.Tensor  # [T] int64
    lengths: tuple[int, ...]


def make_batch(spec: BatchSpec, vocab_size: int, attention_rank: int, batch: int) -> list[StageBatch]:
    """The ``spec.stages`` stages of batch ``batch`` on attention rank ``attention_rank``."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + attention_rank * 10_007 + batch)
    stages = []
    for _ in range(spec.stages):
        lengths = torch.randint(spec.min_len, spec.max_len + 1, (spec.requests_per_stage,), generator=g)
        total = int(lengths.sum())
        tokens = torch.randint(0, vocab_size, (total,), generator=g)
        stages.append(StageBatch(tokens=tokens, lengths=tuple(int(v) for v in lengths)))
    return stages


def concat(stages: list[StageBatch]) -> StageBatch:
    """All stages of a batch as one: the input of the single-process reference forward."""
    return StageBatch(
        tokens=torch.cat([s.tokens for s in stages]),
        lengths=tuple(length for s in stages for length in s.lengths),
    )
