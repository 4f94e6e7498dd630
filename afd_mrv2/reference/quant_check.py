"""The numerics check of a quantized (``--quant w8a8``) embedded run: each MoE output against its float twin.

The bound is derived from the int8 step; :data:`FLOAT_SLACK` covers float round-off.

See docs/internals/reference.md, "afd_mrv2.reference.quant_check".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from afd_mrv2.hooks.quant import INT8_MAX
from afd_mrv2.items import WorkItem
from afd_mrv2.reference.layers import moe_partial
from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.weights import LayerWeights, Weights

#: an upper bound of silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z))), whose maximum is 1.0998 at z = 2.3994
SILU_SLOPE = 1.1
#: float32 round-off of the disaggregated MoE (split over FFN ranks, summed back): the float run's tolerance
FLOAT_SLACK = 1e-5


def step_error(x: torch.Tensor) -> torch.Tensor:
    """``eps_t``: the largest per-element error of token ``t``'s int8 row (half a step), with fp32 slack."""
    return x.abs().amax(dim=1) / (2 * INT8_MAX) * (1 + 1e-5)


def swiglu_error_bound(x: torch.Tensor, eps: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Elementwise bound [N, H] on ``|E(x + dx) - E(x)|`` for ``|dx_t|_inf <= eps_t`` (docs/internals/reference.md)."""
    if x.shape[0] == 0:
        return x.new_zeros((0, w2.shape[0]))
    row_l1 = w13.abs().sum(dim=1)  # ||W1_i||_1 then ||W3_i||_1
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    dg, du = (eps.unsqueeze(1) * row_l1.unsqueeze(0)).chunk(2, dim=-1)
    dh = SILU_SLOPE * dg * (up.abs() + du) + F.silu(gate).abs() * du
    return dh @ w2.abs().T


def moe_error_bound(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: LayerWeights
) -> torch.Tensor:
    """Elementwise bound [T, H] on the MoE output's int8 error, same routing (docs/internals/reference.md)."""
    eps = step_error(x)
    bound = swiglu_error_bound(x, eps, w.shared_w13, w.shared_w2)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        part = swiglu_error_bound(x[token], eps[token], w.experts_w13[expert], w.experts_w2[expert])
        bound.index_add_(0, token, part * topk_weights[token, slot].abs().unsqueeze(1))
    return bound + FLOAT_SLACK


@dataclass
class MoeCheck:
    """Wraps an Attention owner's torch_p2p ``compute``: each combined MoE output against the float MoE.

    ``compute(item, combined)`` of item ``(l + 1, s)`` receives the MoE output of
    what item ``(l, s)`` returned (the owner computes items in order on one
    compute stream, so per stage the returned rows are the next combined ones).
    Statistics: ``max_abs_diff`` (largest ``|combined - float MoE|``),
    ``max_bound`` (largest elementwise bound), ``worst_ratio`` (largest
    ``diff / bound``: <= 1 means every element is within its bound),
    ``compared`` (elements compared).
    """

    compute: Callable[..., Any]
    weights: Weights
    spec: ModelSpec
    max_abs_diff: float = 0.0
    max_bound: float = 0.0
    worst_ratio: float = 0.0
    compared: int = 0
    _pending: dict[int, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __call__(self, item: WorkItem, combined: torch.Tensor | None) -> Any:
        sent = self._pending.pop(item.stage_idx, None)
        if combined is not None and sent is not None and sent[0] == item.layer_idx - 1:
            self._check(sent, combined)
        result = self.compute(item, combined)
        if result is not None:
            x, ids, topk_weights = result
            self._pending[item.stage_idx] = (item.layer_idx, x.clone(), ids.clone(), topk_weights.clone())
        return result

    def _check(self, sent: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor], combined: torch.Tensor) -> None:
        layer, x, ids, topk_weights = sent
        w = self.weights.layers[layer]
        if combined.shape != x.shape:  # a layout whose combined rows are not the dispatched ones: not compared
            return
        reference = moe_partial(x, ids, topk_weights, w, range(self.spec.num_experts), None)
        bound = moe_error_bound(x, ids, topk_weights, w)
        diff = (combined - reference).abs()
        self.max_abs_diff = max(self.max_abs_diff, float(diff.max()) if diff.numel() else 0.0)
        self.max_bound = max(self.max_bound, float(bound.max()) if bound.numel() else 0.0)
        self.worst_ratio = max(self.worst_ratio, float((diff / bound).max()) if diff.numel() else 0.0)
        self.compared += diff.numel()

    def stats(self) -> dict[str, float | int]:
        return {
            "max_abs_diff": self.max_abs_diff,
            "max_bound": self.max_bound,
            "worst_ratio": self.worst_ratio,
            "compared": self.compared,
        }

    def reset(self) -> None:
        self.max_abs_diff = self.max_bound = self.worst_ratio = 0.0
        self.compared = 0
        self._pending.clear()


def summarize(cfg_quant: str, per_rank_modes: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's ``quant`` block from the attention ranks' per-mode ``quant_check`` results."""
    checks = [m["quant_check"] for m in per_rank_modes]
    e2e = [c["end_to_end_max_abs_diff"] for c in checks if c["end_to_end_max_abs_diff"] is not None]
    return {
        "mode": cfg_quant,
        "compared": "each MoE output vs the float MoE of the same input and routing",
        "bound": "elementwise, from the int8 half step max|x_t|/254 through the expert MLPs (reference/quant_check.py)",
        "max_abs_diff": max(c["max_abs_diff"] for c in checks),
        "max_bound": max(c["max_bound"] for c in checks),
        "worst_ratio": max(c["worst_ratio"] for c in checks),
        "elements_compared": sum(c["compared"] for c in checks),
        "end_to_end_max_abs_diff": max(e2e) if e2e else None,
    }
