"""Doubles of ``torch.ops.umdk_cam_op_lib.async_*`` (CAMAsync) over the in-process fabric.

Mimicked contract (argument order as afd-plugin's connector calls them; outputs
as it unpacks them):

* attention ``async_dispatch_send(x, topk_ids, ..., layer_idx, ..., dynamic_quant, group)``
  sends every FFN rank ``f`` the (token, k) rows routed to its experts
  ``[f*E_r, (f+1)*E_r)``, grouped by local expert (stable in token order), plus
  all of the source's tokens as shared-expert input if ``f == source % F``.  Every
  FFN rank gets a message, possibly with zero rows.  ``dynamic_quant=1`` sends
  int8 rows with one float32 scale per row.
* FFN ``async_dispatch_recv(...)`` returns the next arrival from any source as
  (expand_x, expand_x_shared, dynamic_scales, dynamic_scales_shared,
  token_nums_rankid_layeridx = [source tokens, source rank, layer],
  expert_token_nums, expert_token_nums_shared), sized to capacity.
* FFN ``async_combine_send(routed, shared, comm_args, token_nums_rankid_layeridx, ...)``
  returns the outputs to their source; it rejects an empty or int8 routed output
  (the constraint behind the one-token placeholder).
* attention ``async_combine_recv(placeholder, topk_ids, topk_weights, ...)`` pairs
  with the rank's OLDEST outstanding dispatch (it fails loudly if the shapes do
  not match it) and returns ``sum_k w[t, k] * routed(t, k) + shared(t)``.

Ordering: CAM is FIFO per (source, destination, layer); transfers of different
layers or sources may overtake each other (use the fabric's delays to make them).

Stage identity: not an operator argument (the real wire format has none); the
send operators put what their rank stamped on ``doubles.stage_tags`` into each
message's payload metadata and the receive operators hand it back there (see
:mod:`tests.support.doubles_base`).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from types import SimpleNamespace

import torch

from tests.support.doubles_base import CamDoubles, operator


def route_rows(topk_ids: torch.Tensor, ffn_rank: int, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (token*k) positions routed to ``ffn_rank``, grouped by local expert, and their local expert ids."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    local = flat - ffn_rank * experts_per_rank
    positions = torch.nonzero((local >= 0) & (local < experts_per_rank)).flatten()
    order = torch.sort(local[positions], stable=True).indices
    return positions[order], local[positions[order]]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 and its float32 scales."""
    scales = x.abs().amax(dim=1).to(torch.float32).clamp(min=1e-8) / 127.0
    q = torch.round(x.to(torch.float32) / scales.reshape(-1, 1)).clamp(-127, 127).to(torch.int8)
    return q, scales


#: the geometry every async operator takes, in the operators' order (after ``comm_id``, or ``max_seq_len`` in dispatch_send)
CAMASYNC_SIZES = ("batch_size", "hidden_size", "topk", "ffn_size", "attn_size", "expert_per_rank", "rank", "world_size")


class CamAsyncDoubles(CamDoubles):
    NAMESPACE = "umdk_cam_op_lib"
    OPS = ("async_dispatch_send", "async_dispatch_recv", "async_combine_send", "async_combine_recv")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._outstanding: dict[tuple, deque] = defaultdict(deque)  # (group, comm, rank) -> dispatches awaiting combine
        self._receipts: dict[tuple, deque] = defaultdict(deque)  # (group, comm, ffn, src, layer) -> row counts

    @operator(
        "x",
        "topk_ids",
        "comm_args",
        "comm_id",
        "max_seq_len",
        *CAMASYNC_SIZES,
        "layer_idx",
        "tp_size",
        "dynamic_quant",
        "group_name",
    )
    def async_dispatch_send(self, a: SimpleNamespace) -> None:
        x, topk_ids, batch, rank, topk = a.x, a.topk_ids, a.batch_size, a.rank, a.topk
        if tuple(x.shape) != (batch, a.hidden_size) or tuple(topk_ids.shape) != (batch, topk):
            raise RuntimeError(
                f"dispatch_send double: x {tuple(x.shape)} / topk_ids {tuple(topk_ids.shape)} do not match "
                f"batch_size={batch}, hidden_size={a.hidden_size}, topk={topk}"
            )
        if batch > a.max_seq_len or not 0 <= rank < a.attn_size:
            raise RuntimeError(
                f"dispatch_send double: batch {batch} > max_seq_len {a.max_seq_len} or rank {rank} not attention"
            )
        with self._lock:
            self._outstanding[(a.group_name, a.comm_id, rank)].append((a.layer_idx, batch, topk))
        stage = self.stage_tags.claim(rank)

        def send() -> None:
            for f in range(a.ffn_size):
                positions, local = route_rows(topk_ids, f, a.expert_per_rank)
                routed = x[positions // topk]
                shared = x if f == rank % a.ffn_size else x[:0]
                payload = {
                    "tokens": batch,
                    "group_list": torch.bincount(local, minlength=a.expert_per_rank),
                    "stage": stage,
                }
                if a.dynamic_quant:
                    (payload["routed"], payload["scales"]), (payload["shared"], payload["shared_scales"]) = (
                        quantize(routed),
                        quantize(shared),
                    )
                else:
                    payload.update(routed=routed.clone(), shared=shared.clone(), scales=None, shared_scales=None)
                channel = ("dispatch", a.group_name, a.comm_id)
                self._post(channel=channel, src=rank, dst=a.attn_size + f, tag=(a.layer_idx,), payload=payload)

        self._run("async_dispatch_send", rank, send)

    @operator("placeholder", "comm_args", "comm_id", *CAMASYNC_SIZES, "tp_size", "dynamic_quant", "group_name")
    def async_dispatch_recv(self, a: SimpleNamespace) -> tuple[torch.Tensor, ...]:
        batch, hidden = a.batch_size, a.hidden_size
        capacity = batch * a.topk
        dtype = torch.int8 if a.dynamic_quant else a.placeholder.dtype
        fill = 0 if a.dynamic_quant else float("nan")
        expand_x = torch.full((capacity, hidden), fill, dtype=dtype)
        shared = torch.full((batch, hidden), fill, dtype=dtype)
        scales, shared_scales = torch.ones(capacity), torch.ones(batch)
        header = torch.full((3,), -1, dtype=torch.int64)
        expert_counts = torch.zeros(a.expert_per_rank, dtype=torch.int64)
        shared_counts = torch.zeros(1, dtype=torch.int64)

        def receive() -> None:
            m = self.fabric.take(channel=("dispatch", a.group_name, a.comm_id), dst=a.rank)
            p = m.payload
            n, ns = p["routed"].shape[0], p["shared"].shape[0]
            if n > capacity or ns > batch:
                raise RuntimeError(
                    f"dispatch_recv double: {n} routed / {ns} shared rows exceed capacity {capacity}/{batch}"
                )
            expand_x[:n], shared[:ns] = p["routed"], p["shared"]
            if p["scales"] is not None:
                scales[:n], shared_scales[:ns] = p["scales"], p["shared_scales"]
            expert_counts.copy_(p["group_list"])
            shared_counts[0] = ns
            with self._lock:
                self._receipts[(a.group_name, a.comm_id, a.rank, m.src, m.tag[0])].append((n, ns))
            header.copy_(torch.tensor([p["tokens"], m.src, m.tag[0]]))
            self.stage_tags.delivered(a.rank, m)

        self._run("async_dispatch_recv", a.rank, receive)
        return expand_x, shared, scales, shared_scales, header, expert_counts, shared_counts

    @operator(
        "routed",
        "shared",
        "comm_args",
        "token_nums_rankid_layeridx",
        "comm_id",
        *CAMASYNC_SIZES,
        "tp_size",
        "group_name",
    )
    def async_combine_send(self, a: SimpleNamespace) -> None:
        routed, shared, rank = a.routed, a.shared, a.rank
        if routed.dim() != 2 or routed.shape[0] == 0 or routed.shape[1] != a.hidden_size:
            raise RuntimeError(
                f"combine_send double: CAM needs a non-empty (rows, {a.hidden_size}) routed output, "
                f"got {tuple(routed.shape)}"
            )
        if routed.dtype == torch.int8:
            raise RuntimeError("combine_send double: CAM cannot combine an int8 routed output")
        stage = self.stage_tags.claim(rank)

        def send() -> None:
            _tokens, src, layer = (int(v) for v in a.token_nums_rankid_layeridx.tolist())
            with self._lock:
                n, ns = self._receipts[(a.group_name, a.comm_id, rank, src, layer)].popleft()
            if routed.shape[0] != max(n, 1) or shared.shape[0] < ns:
                raise RuntimeError(
                    f"combine_send double: {routed.shape[0]} routed / {shared.shape[0]} shared rows for a "
                    f"dispatch of {n} / {ns} rows (a zero-row dispatch takes exactly one placeholder row)"
                )
            payload = {"routed": routed[:n].clone(), "shared": shared[:ns].clone(), "stage": stage}
            self._post(channel=("combine", a.group_name, a.comm_id), src=rank, dst=src, tag=(layer,), payload=payload)

        self._run("async_combine_send", rank, send)

    @operator("placeholder", "topk_ids", "topk_weights", "comm_args", "comm_id", *CAMASYNC_SIZES, "group_name")
    def async_combine_recv(self, a: SimpleNamespace) -> torch.Tensor:
        topk_ids, topk_weights, rank = a.topk_ids, a.topk_weights, a.rank
        with self._lock:
            queue = self._outstanding[(a.group_name, a.comm_id, rank)]
            if not queue:
                raise RuntimeError(f"combine_recv double: rank {rank} has no outstanding dispatch")
            layer, batch, k = queue[0]
            if (
                (batch, k) != (a.batch_size, a.topk)
                or tuple(topk_ids.shape) != (batch, k)
                or tuple(topk_weights.shape) != (batch, k)
            ):
                raise RuntimeError(
                    f"combine_recv double: arguments (batch {a.batch_size}, topk_ids {tuple(topk_ids.shape)}) do "
                    f"not pair with the oldest outstanding dispatch (layer {layer}, batch {batch}, topk {k})"
                )
            queue.popleft()
        out = torch.full((batch, a.hidden_size), float("nan"), dtype=a.placeholder.dtype)

        def receive() -> None:
            acc = torch.zeros((batch, a.hidden_size), dtype=torch.float32)
            weights = topk_weights.reshape(-1).to(torch.float32)
            for f in range(a.ffn_size):
                m = self.fabric.take(
                    channel=("combine", a.group_name, a.comm_id),
                    dst=rank,
                    match=lambda m, f=f: m.src == a.attn_size + f and m.tag == (layer,),
                )
                self.stage_tags.delivered(rank, m)
                positions, _ = route_rows(topk_ids, f, a.expert_per_rank)
                rows = m.payload["routed"].to(torch.float32) * weights[positions].reshape(-1, 1)
                acc.index_add_(0, positions // k, rows)
                if m.payload["shared"].shape[0]:
                    acc += m.payload["shared"].to(torch.float32)
            out.copy_(acc)

        self._run("async_combine_recv", rank, receive)
        return out
