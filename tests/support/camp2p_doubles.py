"""Doubles of ``torch.ops.afd_ascend.a2e`` / ``e2a`` (CAMP2P) over the in-process fabric.

Mimicked contract (afd-plugin ``csrc/npu/torch_extension/torch_binding.cpp``):
world ranks are FFN ``0..F-1`` then attention ``F..F+A-1``; FFN rank ``r`` serves
attention ranks ``r*g .. r*g+g-1`` (``g = A / F``) over the HCCL group
``group_ep``, which is a FIFO per (group, source, destination).

* attention ``a2e(x, ...)`` sends ``x``; returns placeholder tensors.
* FFN ``a2e(x_empty, ..., batch_size, ...)`` receives one message from each of its
  attention ranks in rank order into ``expand_x`` (``batch_size`` rows, real rows
  first), ``atten_batch_size`` (rows per attention rank) and ``x_active_mask``.
* FFN ``e2a(expand_x, atten_batch_size, ...)`` splits the rows back to the
  attention ranks; attention ``e2a(ref, ...)`` receives ``ref.shape[0]`` rows.

Stage identity: not an operator argument (the real wire format has none; the
real stages are the per-stage HCCL groups); the send calls put what their rank
stamped on ``doubles.stage_tags`` into each message's payload metadata and the
receive calls hand it back there (see :mod:`tests.support.doubles_base`).

Deviations, on purpose: the real operators produce bf16; the doubles keep the
input dtype so float32 tests can compare exactly.  More than ``batch_size``
received rows is an error here (the real kernel would overrun its buffer).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.support.doubles_base import CamDoubles, operator

#: the arguments a2e and e2a share, in the operators' order (after their tensors)
CAMP2P_SIZES = (
    "batch_size",
    "hidden_size",
    "topk",
    "expert_rank_size",
    "attention_rank_size",
    "rank",
    "group_ep",
    "aiv_num",
)


class CamP2PDoubles(CamDoubles):
    NAMESPACE = "afd_ascend"
    OPS = ("a2e", "e2a")

    @staticmethod
    def _group(ffn: int, attention: int) -> int:
        if attention % ffn:
            raise RuntimeError(
                f"afd_ascend double: attention ranks ({attention}) must be a multiple of FFN ranks ({ffn})"
            )
        return attention // ffn

    @operator("x", "expert_ids", "scales", *CAMP2P_SIZES, "compute_gate")
    def a2e(self, a: SimpleNamespace) -> list[torch.Tensor]:
        x, rank, batch, hidden = a.x, a.rank, a.batch_size, a.hidden_size
        ffn, attention = a.expert_rank_size, a.attention_rank_size
        g = self._group(ffn, attention)
        per_ffn = -(-attention // ffn)
        if rank >= ffn:  # attention: send x to the FFN rank serving it
            dst = (rank - ffn) // g
            if tuple(x.shape) != (x.shape[0], hidden):
                raise RuntimeError(f"a2e double: x must be (tokens, {hidden}), got {tuple(x.shape)}")
            stage = self.stage_tags.claim(rank)

            def send() -> None:
                payload = {"x": x.clone(), "stage": stage}
                self._post(channel=("a2e", a.group_ep), src=rank, dst=dst, tag=(), payload=payload)

            self._run("a2e", rank, send)
            return [
                x.new_empty((1, 1)),
                torch.empty((1, 1), dtype=torch.int32),
                torch.empty((1, 1)),
                torch.zeros(per_ffn, dtype=torch.int32),
                torch.zeros(1, dtype=torch.bool),
            ]
        expand_x = torch.full((batch, hidden), float("nan"), dtype=x.dtype)
        counts = torch.full((g,), -1, dtype=torch.int32)
        mask = torch.zeros(batch, dtype=torch.bool)
        sources = [ffn + rank * g + i for i in range(g)]

        def receive() -> None:
            row = 0
            for i, src in enumerate(sources):
                message = self.fabric.take(channel=("a2e", a.group_ep), dst=rank, match=lambda m, s=src: m.src == s)
                self.stage_tags.delivered(rank, message)
                rows = message.payload["x"]
                if row + rows.shape[0] > batch:
                    raise RuntimeError(f"a2e double: {row + rows.shape[0]} rows received for batch_size {batch}")
                expand_x[row : row + rows.shape[0]] = rows
                counts[i] = rows.shape[0]
                row += rows.shape[0]
            mask[:row] = True
            expand_x[row:] = 0

        self._run("a2e", rank, receive)
        return [
            expand_x,
            torch.zeros((batch, a.topk), dtype=torch.int32),
            torch.zeros((batch, a.topk)),
            counts,
            mask,
        ]

    @operator("expand_x", "atten_batch_size", *CAMP2P_SIZES)
    def e2a(self, a: SimpleNamespace) -> torch.Tensor:
        expand_x, rank = a.expand_x, a.rank
        ffn, attention = a.expert_rank_size, a.attention_rank_size
        g = self._group(ffn, attention)
        if rank < ffn:  # FFN: split the rows back to its attention ranks
            stage = self.stage_tags.claim(rank)

            def send() -> None:
                row = 0
                for i, n in enumerate(a.atten_batch_size.tolist()):
                    payload = {"x": expand_x[row : row + n].clone(), "stage": stage}
                    self._post(channel=("e2a", a.group_ep), src=rank, dst=ffn + rank * g + i, tag=(), payload=payload)
                    row += n

            self._run("e2a", rank, send)
            return expand_x.new_empty((1, 1))
        out = torch.full((expand_x.shape[0], a.hidden_size), float("nan"), dtype=expand_x.dtype)
        src = (rank - ffn) // g

        def receive() -> None:
            message = self.fabric.take(channel=("e2a", a.group_ep), dst=rank, match=lambda m: m.src == src)
            self.stage_tags.delivered(rank, message)
            rows = message.payload["x"]
            if rows.shape[0] != out.shape[0]:
                raise RuntimeError(f"e2a double: received {rows.shape[0]} rows for a {out.shape[0]}-row reference")
            out.copy_(rows)

        self._run("e2a", rank, receive)
        return out
