"""CAMAsync's typed operator view, transfer state and compute payloads.

Kept apart from :mod:`afd_mrv2.hooks.cam.camasync` (the hook implementations) so
the state the operators exchange can be read on its own; see that module's
docstring for the operator contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_mrv2.errors import PluginError
from afd_mrv2.hooks.cam.ops import BoundOp, OpSet

CAMASYNC_OPS = ("async_dispatch_send", "async_dispatch_recv", "async_combine_send", "async_combine_recv")


@dataclass(frozen=True)
class CamAsyncOps:
    """The four CAM async operators, typed: ``ops.dispatch_send(stream, *args)`` and so on."""

    dispatch_send: BoundOp
    dispatch_recv: BoundOp
    combine_send: BoundOp
    combine_recv: BoundOp

    @classmethod
    def of(cls, ops: OpSet) -> CamAsyncOps:
        return cls(*(ops[name] for name in CAMASYNC_OPS))


@dataclass
class AFDAsyncTransferState:
    """One CAM transfer, from dispatch-recv to combine-send (FFN) or dispatch to combine (attention).

    ``layer_idx``, ``stage_idx`` and ``num_stages`` are the transfer's stage
    identity (on the FFN side: from the stage-tag side channel, or inferred from
    the arrival order without one).
    ``batch_size``, ``hidden_size``, ``topk`` and ``layer_idx`` size the operators
    (the FFN side passes its capacity, ``max_seq_len``, as afd-plugin does;
    ``source_tokens`` is what the source actually dispatched);
    ``token_nums_rankid_layeridx`` routes the combine back to its source;
    ``group_list`` (rows per local expert), ``dynamic_scales``,
    ``dynamic_scales_shared`` and ``expert_token_nums_shared`` are the metadata of
    the FFN compute payload (the rows themselves are :class:`CamAsyncRows`, in the
    item's input slot); ``topk_ids`` / ``topk_weights`` / ``reference`` are what
    the attention side combines with.  Per-item transfer state: it travels in
    ``work.transfer`` and is never shared between items.
    """

    batch_size: int = 1
    hidden_size: int = 1
    topk: int = 1
    layer_idx: int = 0
    stage_idx: int = 0
    num_stages: int = 1
    source_rank: int = -1
    source_tokens: int = 0
    num_routed: int = 0
    num_shared: int = 0
    token_nums_rankid_layeridx: torch.Tensor | None = None
    expert_token_nums_shared: torch.Tensor | None = None
    group_list: torch.Tensor | None = None
    dynamic_scales: torch.Tensor | None = None
    dynamic_scales_shared: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    reference: torch.Tensor | None = None


@dataclass(frozen=True)
class CamAsyncRows:
    """The rows one FFN item received (its input slot): routed and shared, as sent (int8 with dynamicQuant)."""

    routed: torch.Tensor  # expand_x[:num_routed]
    shared: torch.Tensor  # expand_x_shared[:num_shared]


@dataclass
class CamAsyncFfnSend:
    """An FFN output slot: what compute wrote for combine-send, and the slot's one-row placeholder.

    ``placeholder`` is the slot's preallocated zero row, made once (per dtype) and
    reused: CAM combine-send cannot take an empty routed result.
    """

    routed: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    placeholder: torch.Tensor | None = None


@dataclass(frozen=True)
class CamAsyncFfnBatch:
    """What FFN ``compute`` receives: the routed rows grouped by local expert, the shared rows, as received.

    With ``dynamicQuant = 1`` the rows are int8 and ``dynamic_scales`` /
    ``dynamic_scales_shared`` hold one float32 scale per row (the received
    dynamic scales, read only after dispatch-recv completed): a W8A8 compute
    uses them directly; :meth:`dequantized` gives the float rows for one that
    does not.  Without it the rows are float and the scales None.
    """

    layer_idx: int
    hidden_states: torch.Tensor
    group_list: torch.Tensor
    shared_hidden_states: torch.Tensor
    dynamic_scales: torch.Tensor | None = None
    dynamic_scales_shared: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.hidden_states.dtype == torch.int8

    def dequantized(self, dtype: torch.dtype) -> CamAsyncFfnBatch:
        """The same batch with the rows times their scales in ``dtype`` (float rows pass through)."""
        return CamAsyncFfnBatch(
            self.layer_idx,
            dequantize(self.hidden_states, self.dynamic_scales, dtype),
            self.group_list,
            dequantize(self.shared_hidden_states, self.dynamic_scales_shared, dtype),
        )


@dataclass(frozen=True)
class CamAsyncFfnOutput:
    routed: torch.Tensor
    shared: torch.Tensor | None = None


@dataclass(frozen=True)
class CamAsyncDispatch:
    """What attention ``compute`` returns for layers that dispatch."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def dequantize(x: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows times their dynamic scale; other dtypes pass through."""
    if x.dtype != torch.int8:
        return x
    if scales is None:
        raise PluginError("camasync: int8 activations arrived without dynamic scales")
    return (x.to(torch.float32) * scales.reshape(-1, 1).to(torch.float32)).to(dtype)
