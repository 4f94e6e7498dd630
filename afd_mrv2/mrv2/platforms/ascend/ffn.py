"""FFN role on vLLM-Ascend: the routed experts computed by vllm-ascend's own layer and quant method.

:func:`routed_experts_fn`, :func:`check_held`: the same ``quant_method.apply`` call vllm-ascend's
``forward_impl`` makes, inside its forward context, with the top-k the Attention side sent.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.platforms.ascend" and RFC 0005 §3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm_ascend.ascend_forward_context import _EXTRA_CTX, set_ascend_forward_context
from vllm_ascend.ops.fused_moe.moe_comm_method import get_moe_comm_method

from afd_mrv2.errors import ConfigError
from afd_mrv2.mrv2.ffn.server import ExpertsFn


def check_held(held: Sequence[int], num_experts: int) -> None:
    """Refuse a share of the experts: vllm-ascend's comm methods are sized for the layer's experts as built
    (one FFN rank per replica holding every expert, expert parallel 1, first)."""
    if list(held) != list(range(num_experts)):
        raise ConfigError(
            "afd.num_ffn_ranks",
            f"on vLLM-Ascend an FFN rank holds every routed expert (expert parallel 1); this rank would hold "
            f"{len(held)} of {num_experts}",
        )


def compute_routed(
    layer: Any, vllm_config: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``layer``'s routed experts for ``x`` as ``forward_impl`` computes them, from the given top-k."""
    num_tokens = int(x.shape[0])
    with set_ascend_forward_context(None, vllm_config, num_tokens=num_tokens):
        comm_type = _EXTRA_CTX.moe_comm_type  # what the context selected for num_tokens
        comm = get_moe_comm_method(comm_type, layer.moe_config)
        if comm is None:
            raise RuntimeError(
                f"{layer.layer_name}: vllm-ascend set up no {comm_type} comm method for this layer "
                "(its AscendMoERunner sets them up when the model is built)"
            )
        _EXTRA_CTX.moe_comm_method = comm  # the layer's own comm method, as forward_impl sets it
        result = layer.quant_method.apply(
            layer=layer,
            x=x,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            shared_experts=None,
            shared_experts_input=None,
        )
    routed: torch.Tensor = result.routed_out
    return routed


def routed_experts_fn(layer: Any, vllm_config: Any) -> ExpertsFn:
    """``layer``'s routed experts as the FFN loop calls them (:data:`~afd_mrv2.mrv2.ffn.server.ExpertsFn`)."""

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return compute_routed(layer, vllm_config, x, topk_weights, topk_ids)

    return run
