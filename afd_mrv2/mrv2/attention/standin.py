"""Stand-in quant methods for routed-experts layers that hold no expert weights.

:class:`RemoteExpertsMethod`: the Attention role's, one AFD round trip per ``apply``.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.attention.standin".
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder
from vllm.model_executor.utils import set_weight_attrs

from afd_mrv2.mrv2.attention import remote  # registers the afd_mrv2::remote_routed_experts op

#: The placeholders of a layer without a held set (``real`` None: vLLM-Ascend's layer, which keeps every
#: expert local): upstream's unquantized names (biases only when ``moe.has_bias``), loaded by discarding.
WEIGHT_NAMES = ("w13_weight", "w2_weight")
BIAS_NAMES = ("w13_bias", "w2_bias")


def discard_weight(
    param: torch.nn.Parameter,
    loaded_weight: torch.Tensor,
    weight_name: str | None = None,
    shard_id: str | None = None,
    expert_id: int | None = None,
    return_success: bool = False,
) -> bool | None:
    """A ``weight_loader`` that drops the checkpoint tensor (this process holds no routed experts)."""
    del param, loaded_weight, weight_name, shard_id, expert_id
    return True if return_success else None


class WeightlessExpertsMethod(FusedMoEMethodBase):
    """A quant method whose layer holds no routed-expert storage.

    With ``real`` (the method upstream would have used, ``RoutedExperts._get_quant_method``) on a layer whose
    held set is empty: ``real.create_weights`` with ``num_experts=0`` registers every parameter name, dtype
    and attribute a checkpoint of it carries (scales included), and upstream's loader skips each expert
    (it maps to -1).  Without: :data:`WEIGHT_NAMES` placeholders whose loader discards.  Nothing else of
    ``real`` is used.
    """

    def __init__(self, moe: FusedMoEConfig, layer_index: int, real: FusedMoEMethodBase | None = None) -> None:
        super().__init__(moe)
        self.layer_index = layer_index
        self.real = real

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        del num_experts  # 0 whatever the layer was told: this process holds no routed expert
        if self.real is None:
            for name in WEIGHT_NAMES + (BIAS_NAMES if self.moe.has_bias else ()):
                placeholder = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
                set_weight_attrs(placeholder, {"weight_loader": discard_weight})
                layer.register_parameter(name, placeholder)
            return
        self.real.create_weights(
            layer=layer,
            num_experts=0,
            hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition,
            params_dtype=params_dtype,
            **extra_weight_attrs,
        )

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig | None:
        del layer
        return FusedMoEQuantConfig.make()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        del layer  # nothing was loaded

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        del layer
        routed = self.routed(x, topk_weights, topk_ids)
        if shared_experts is not None:  # after the round trip, on this thread (docs/internals/vllm-roles.md)
            shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        return routed

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        """True: ``apply`` runs the shared experts itself, after the routed experts (docs/internals/vllm-roles.md)."""
        return True

    def routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' combined output for ``x`` (``[T, H]``)."""
        raise NotImplementedError


class RemoteExpertsMethod(WeightlessExpertsMethod):
    """Attention role: the routed experts run on the FFN role (one AFD round trip per call)."""

    @property
    def supports_internal_mk(self) -> bool:
        """True: vLLM's MoE runner then skips its naive dispatch and combine among data-parallel ranks
        (``MoERunner.do_naive_dispatch_combine``): each Attention rank sends its own tokens to the FFN ranks,
        none to its DP peers, which hold no expert either (docs/vllm.md, "Attention groups: data and tensor parallelism (M:N)").
        vLLM's LoRA and elastic EP also read this flag; the support matrix refuses both with AFD."""
        return True

    def routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        assert remote.OP_NAME == "afd_mrv2::remote_routed_experts"
        routed: torch.Tensor = torch.ops.afd_mrv2.remote_routed_experts(x, topk_weights, topk_ids, self.layer_index)
        return routed
