"""A paged KV cache and chunked-prefill attention for the reference model.

:class:`KvLayout`, :class:`KvCache`, :class:`KvCacheError`, :func:`chunked_self_attention`.

See docs/internals/async-moe-stages.md, "afd_mrv2.reference.kvcache".
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd_mrv2.reference.layers import attend, project_qkv
from afd_mrv2.reference.weights import LayerWeights
from afd_mrv2.stages import PAD_SLOT_ID, StageMetadata

BLOCK_SIZE = 16


class KvCacheError(RuntimeError):
    """A stage read K/V that no stage wrote (its context has not run yet)."""


@dataclass(frozen=True)
class KvLayout:
    """Block tables of one batch's requests (rows in batch order) over ``num_blocks`` blocks."""

    block_size: int
    block_tables: tuple[tuple[int, ...], ...]
    num_blocks: int

    @classmethod
    def allocate(cls, seq_lens: Sequence[int], *, block_size: int = BLOCK_SIZE, seed: int = 0) -> KvLayout:
        """Enough blocks for each request's ``seq_len`` tokens, block ids in a seeded shuffled order."""
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        needed = [-(-int(n) // block_size) for n in seq_lens]
        ids = list(range(sum(needed)))
        random.Random(seed).shuffle(ids)
        tables, start = [], 0
        for count in needed:
            tables.append(tuple(ids[start : start + count]))
            start += count
        return cls(block_size, tuple(tables), len(ids))

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def slots(self, table: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """Slots of ``positions`` of the request whose block table is ``table``."""
        blocks = torch.as_tensor(table, dtype=torch.int64)
        positions = positions.to(torch.int64)
        if positions.numel() and int(positions.max()) >= blocks.numel() * self.block_size:
            raise ValueError(f"position {int(positions.max())} is past the request's {blocks.numel()} blocks")
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def slot_mapping(self, positions: Sequence[torch.Tensor]) -> torch.Tensor:
        """The batch's flattened slot mapping: request ``r``'s tokens sit at ``positions[r]``."""
        if len(positions) != len(self.block_tables):
            raise ValueError(f"expected positions for {len(self.block_tables)} requests, got {len(positions)}")
        parts = [self.slots(t, p) for t, p in zip(self.block_tables, positions, strict=True)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class KvCache:
    """K and V rows per (layer, slot), with a record of which slots were written."""

    def __init__(self, num_layers: int, num_slots: int, hidden: int, dtype: torch.dtype = torch.float32) -> None:
        self.k = torch.zeros(num_layers, num_slots, hidden, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.written = torch.zeros(num_layers, num_slots, dtype=torch.bool)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows of ``k``, ``v`` at ``slot_mapping`` (one slot per row; PAD_SLOT_ID rows are not stored)."""
        if slot_mapping.shape[0] != k.shape[0] or k.shape != v.shape:
            raise ValueError(f"write: {slot_mapping.shape[0]} slots for {k.shape[0]}/{v.shape[0]} K/V rows")
        real = slot_mapping != PAD_SLOT_ID
        slots = slot_mapping[real].to(torch.int64)
        self.k[layer, slots] = k[real]
        self.v[layer, slots] = v[real]
        self.written[layer, slots] = True

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        missing = slots[~self.written[layer, slots]]
        if missing.numel():
            raise KvCacheError(
                f"layer {layer}: {missing.numel()} KV slot(s) read before any stage wrote them "
                f"(first: {missing[:4].tolist()}); a continued request's context must run first"
            )
        return self.k[layer, slots], self.v[layer, slots]


def chunked_self_attention(
    x: torch.Tensor,
    w: LayerWeights,
    num_heads: int,
    meta: StageMetadata,
    block_tables: Sequence[Sequence[int]],
    layout: KvLayout,
    cache: KvCache,
    layer: int,
) -> torch.Tensor:
    """Causal attention of one stage ([num_input_tokens, H]) with its requests' KV context.

    ``block_tables``: one row per request of the stage (the parent's rows
    ``stage.request_slice``).  Request ``i`` has query rows
    ``query_start_loc[i]:query_start_loc[i+1]`` at positions
    ``context_lens[i] .. seq_lens[i] - 1`` and attends to its ``seq_lens[i]`` keys
    read from the cache.  Padding rows (past the real tokens) come out zero.
    """
    q, k, v = project_qkv(x, w)
    cache.write(layer, meta.slot_mapping, k, v)
    out = torch.zeros_like(x)
    bounds = meta.query_start_loc.tolist()
    if len(block_tables) != len(bounds) - 1:
        raise ValueError(
            f"expected {len(bounds) - 1} block tables (one per request of the stage), got {len(block_tables)}"
        )
    for i, table in enumerate(block_tables):
        a, b = bounds[i], bounds[i + 1]
        context, seq_len = int(meta.context_lens[i]), int(meta.seq_lens[i])
        positions = meta.positions[a:b].to(torch.int64)
        if not torch.equal(positions, torch.arange(context, seq_len)):
            raise ValueError(
                f"request {i} of stage {meta.stage.index}: positions {positions.tolist()[:4]}... do not continue "
                f"its context of {context} tokens up to seq_len {seq_len}"
            )
        keys, values = cache.read(layer, layout.slots(table, torch.arange(seq_len)))
        out[a:b] = attend(q[a:b], keys, values, num_heads, context)
    return out @ w.wo.T
