"""The reference model run in the async-MoE planner's two stages, for split-vs-unsplit proofs.

:func:`plan_batch`, :func:`staged_attention_step`, :func:`staged_forward`.

See docs/internals/async-moe-stages.md, "afd_mrv2.reference.staged".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from afd_mrv2.reference.forward import embed, final_norm, moe_input
from afd_mrv2.reference.kvcache import BLOCK_SIZE, KvCache, KvLayout, chunked_self_attention
from afd_mrv2.reference.layers import moe_partial, rms_norm
from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.weights import Weights
from afd_mrv2.stages import Stage, StageMetadata, build_stage_metadata, merge_tokens, plan_stages, split_tokens
from afd_mrv2.stages.layout import unsplit_stage
from afd_mrv2.stages.metadata import IntLike


@dataclass(frozen=True)
class SplitBatch:
    """One prefill batch planned into two stages, with each stage's attention metadata."""

    split: str
    lengths: tuple[int, ...]
    stages: tuple[Stage, ...]  # the planner's two, or one for a step that runs unsplit
    metadata: tuple[StageMetadata, ...]
    layout: KvLayout
    unsplit_why: str = ""  # why the step runs unsplit (one stage), "" when split

    def block_tables(self, stage: int) -> tuple[tuple[int, ...], ...]:
        """Block-table rows of the stage's requests (vLLM slices them by request_slice)."""
        return self.layout.block_tables[self.stages[stage].request_slice]

    @property
    def continued(self) -> list[int]:
        """Parent indices of requests cut by the split (in both stages: only under ``token``)."""
        if len(self.stages) < 2:
            return []
        first, second = (s.request_slice for s in self.stages)
        return list(range(second.start, min(first.stop, second.stop)))

    def summary(self) -> dict[str, Any]:
        """The split as data (for reports): tokens and requests per stage, the continued request(s)."""
        second = self.metadata[-1]
        offset = self.stages[-1].request_slice.start
        return {
            "split": self.split,
            "stages": len(self.stages),
            "unsplit": self.unsplit_why,
            "lengths": list(self.lengths),
            "stage_tokens": [s.num_tokens for s in self.stages],
            "stage_requests": [[s.request_slice.start, s.request_slice.stop - 1] for s in self.stages],
            "continued": [
                {
                    "request": r,
                    "context": int(second.context_lens[r - offset]),
                    "query": int(second.query_lens[r - offset]),
                    "seq_len": int(second.seq_lens[r - offset]),
                }
                for r in self.continued
            ],
        }

    def describe(self) -> str:
        """E.g. ``token split: stage 1 = 37 tokens (requests 0-2), stage 2 = 36 tokens (requests 2-4), request 2 continued (...)``."""
        return describe_summary(self.summary())


def describe_summary(summary: dict[str, Any]) -> str:
    parts = []
    for index, (tokens, (r0, r1)) in enumerate(zip(summary["stage_tokens"], summary["stage_requests"], strict=True), 1):
        requests = f"request {r0}" if r0 == r1 else f"requests {r0}-{r1}"
        parts.append(f"stage {index} = {_tokens(tokens)} ({requests})")
    if summary.get("stages", 2) == 1:
        return (
            f"{summary['split']} split: unsplit, 1 stage = {_tokens(summary['stage_tokens'][0])} ({summary['unsplit']})"
        )
    text = f"{summary['split']} split: " + ", ".join(parts)
    for c in summary["continued"]:
        text += (
            f", request {c['request']} continued (stage 2 prefills its positions {c['context']}..{c['seq_len'] - 1} "
            f"over {_tokens(c['context'])} of KV context)"
        )
    if not summary["continued"]:
        text += ", no request cut"
    return text


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def plan_batch(
    lengths: Sequence[int],
    *,
    split: str,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    block_size: int = BLOCK_SIZE,
    seed: int = 0,
    unsplit: tuple[int, str] | None = None,
) -> SplitBatch | None:
    """Plan a batch of fresh prefills (request ``r`` has ``lengths[r]`` tokens, no cached context).

    None when the planner cannot form two stages (``request`` with one request,
    ``token`` with fewer than two tokens).  ``unsplit = (rows, why)`` plans the
    step as ONE stage of ``rows`` physical rows instead (the rank-consistent
    fallback: :func:`afd_mrv2.stages.layout.decide_split`).
    """
    lengths = tuple(int(n) for n in lengths)
    stages: tuple[Stage, ...] | None
    if unsplit is not None:
        stages = (unsplit_stage(lengths, physical_tokens=unsplit[0]),)
    else:
        stages = plan_stages(lengths, split=split, tp_size=tp_size, sequence_parallel=sequence_parallel)
    if stages is None:
        return None
    layout = KvLayout.allocate(lengths, block_size=block_size, seed=seed)
    positions = [torch.arange(n) for n in lengths]
    parent: dict[str, IntLike] = {
        "query_start_loc": list(accumulate(lengths, initial=0)),
        "seq_lens": list(lengths),
        "positions": torch.cat(positions),
        "slot_mapping": layout.slot_mapping(positions),
    }
    metadata = tuple(build_stage_metadata(stage, **parent) for stage in stages)
    return SplitBatch(split, lengths, stages, metadata, layout, unsplit[1] if unsplit else "")


def new_cache(spec: ModelSpec, batch: SplitBatch) -> KvCache:
    return KvCache(spec.num_layers, batch.layout.num_slots, spec.hidden_size)


def stage_embeddings(weights: Weights, tokens: torch.Tensor, batch: SplitBatch) -> list[torch.Tensor]:
    """Each stage's physical input rows (real tokens' embeddings, then zero padding)."""
    return split_tokens(embed(weights, tokens), batch.stages)


def staged_attention_step(
    weights: Weights, spec: ModelSpec, layer: int, h: torch.Tensor, batch: SplitBatch, stage: int, cache: KvCache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s attention half for one stage: (residual, MoE input, topk_ids, topk_weights)."""
    h = staged_attention(weights, spec, layer, h, batch, stage, cache)
    return (h, *moe_input(weights, spec, layer, h))


def staged_attention(
    weights: Weights, spec: ModelSpec, layer: int, h: torch.Tensor, batch: SplitBatch, stage: int, cache: KvCache
) -> torch.Tensor:
    """Layer ``layer``'s attention for one stage's physical rows, added to the residual ``h``."""
    w = weights.layers[layer]
    attn = chunked_self_attention(
        rms_norm(h, w.attn_norm, spec.rms_eps),
        w,
        spec.num_heads,
        batch.metadata[stage],
        batch.block_tables(stage),
        batch.layout,
        cache,
        layer,
    )
    return h + attn


def staged_forward(weights: Weights, spec: ModelSpec, tokens: torch.Tensor, batch: SplitBatch) -> torch.Tensor:
    """Final hidden states [T, H] of the batch run stage by stage, layer-major; compare with reference_forward."""
    if tokens.numel() != sum(batch.lengths):
        raise ValueError(f"expected {sum(batch.lengths)} tokens for requests {batch.lengths}, got {tokens.numel()}")
    everything = range(spec.num_experts)
    cache = new_cache(spec, batch)
    hs = stage_embeddings(weights, tokens, batch)
    for layer in range(spec.num_layers):
        for s in range(len(batch.stages)):
            h, x, ids, topk_weights = staged_attention_step(weights, spec, layer, hs[s], batch, s, cache)
            hs[s] = h + moe_partial(x, ids, topk_weights, weights.layers[layer], everything, None)
    return merge_tokens([final_norm(weights, spec, h) for h in hs], batch.stages)
