"""Stage-local metadata: rebuild one stage's attention inputs from the parent batch's.

See docs/internals/async-moe-stages.md, "afd_mrv2.stages.metadata".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd_mrv2.stages.planner import Stage

PAD_SLOT_ID = -1

IntLike = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class StageMetadata:
    """Attention metadata of one stage, in stage-local coordinates.

    query_start_loc: ``(num_requests + 1,)``, from 0 to the stage's real tokens.
    seq_lens: ``(num_requests,)``, KV length after this stage ran (see module doc).
    context_lens: ``seq_lens - query_lens``: tokens already cached before the stage.
    positions, slot_mapping: ``(num_input_tokens,)``, real tokens then padding.
    """

    stage: Stage
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max().item())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max().item())


def build_stage_metadata(
    stage: Stage,
    *,
    query_start_loc: IntLike,
    seq_lens: IntLike,
    positions: IntLike,
    slot_mapping: IntLike,
) -> StageMetadata:
    """Rebuild ``stage``'s metadata from the parent batch's (see docs/internals/async-moe-stages.md).

    :param query_start_loc: parent ``(n + 1,)`` prefix sums of scheduled tokens.
    :param seq_lens: parent ``(n,)`` sequence lengths (cached + scheduled).
    :param positions: parent positions, at least ``query_start_loc[-1]`` long
        (extra entries, e.g. DP padding, are ignored).
    :param slot_mapping: parent KV slots, same length rule as ``positions``.
    """
    qsl = _ints(query_start_loc, "query_start_loc")
    lens = _ints(seq_lens, "seq_lens")
    pos = torch.as_tensor(positions)
    slots = torch.as_tensor(slot_mapping)
    n = lens.numel()
    if qsl.numel() != n + 1 or int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc: expected {n + 1} prefix sums starting at 0, got {qsl.tolist()}")
    total = int(qsl[-1])
    if stage.request_slice.stop > n or stage.token_slice.stop > total:
        raise ValueError(
            f"stage {stage.index} ({stage.request_slice}, {stage.token_slice}) does not fit the parent batch"
        )
    if pos.numel() < total or slots.numel() < total:
        raise ValueError(
            f"positions/slot_mapping: expected at least {total} entries, got {pos.numel()}/{slots.numel()}"
        )
    parent_query = qsl[1:] - qsl[:-1]
    if bool((lens < parent_query).any()):
        raise ValueError("seq_lens: every sequence length must be >= its scheduled tokens")

    a, b = stage.token_slice.start, stage.token_slice.stop
    r0, r1 = stage.request_slice.start, stage.request_slice.stop
    q0 = qsl[r0:r1]
    q1 = qsl[r0 + 1 : r1 + 1]
    starts = torch.clamp(q0, min=a)
    stops = torch.clamp(q1, max=b)
    query = stops - starts
    if bool((query <= 0).any()):
        raise ValueError(f"stage {stage.index}: its request slice holds a request with no token in {stage.token_slice}")
    stage_qsl = torch.zeros(r1 - r0 + 1, dtype=torch.int32)
    stage_qsl[1:] = torch.cumsum(query, 0)
    stage_lens = (lens[r0:r1] - torch.clamp(q1 - b, min=0)).to(torch.int32)
    return StageMetadata(
        stage=stage,
        query_start_loc=stage_qsl,
        seq_lens=stage_lens,
        context_lens=(stage_lens - query).to(torch.int32),
        positions=_padded(pos[a:b], stage.num_input_tokens, 0),
        slot_mapping=_padded(slots[a:b], stage.num_input_tokens, PAD_SLOT_ID),
    )


def split_tokens(tokens: torch.Tensor, stages: Sequence[Stage], *, pad_value: float = 0) -> list[torch.Tensor]:
    """Each stage's physical rows of a per-token tensor (real rows, then padding)."""
    return [_padded(tokens[s.token_slice], s.num_input_tokens, pad_value) for s in stages]


def merge_tokens(outputs: Sequence[torch.Tensor], stages: Sequence[Stage]) -> torch.Tensor:
    """Inverse of :func:`split_tokens`: drop each stage's padding, concatenate in order."""
    if len(outputs) != len(stages):
        raise ValueError(f"expected one output per stage ({len(stages)}), got {len(outputs)}")
    for out, stage in zip(outputs, stages, strict=True):
        if out.shape[0] != stage.num_input_tokens:
            raise ValueError(f"stage {stage.index}: expected {stage.num_input_tokens} rows, got {out.shape[0]}")
    return torch.cat([out[: s.num_tokens] for out, s in zip(outputs, stages, strict=True)])


def _padded(rows: torch.Tensor, length: int, value: float) -> torch.Tensor:
    if rows.shape[0] == length:
        return rows.clone()
    out = rows.new_full((length, *rows.shape[1:]), value)
    out[: rows.shape[0]] = rows
    return out


def _ints(values: IntLike, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(values)
    if tensor.dim() != 1 or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise ValueError(f"{name}: expected a 1-D integer tensor or list, got {tuple(tensor.shape)} {tensor.dtype}")
    return tensor.to(torch.int64)
