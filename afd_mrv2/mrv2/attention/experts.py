"""The MoE seam: afd-mrv2's out-of-tree replacement of vLLM's ``RoutedExperts`` layer.

:class:`AfdRoutedExperts`, installed by :func:`register_routed_experts`.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.attention.experts".
"""

from __future__ import annotations

import logging

from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import maybe_get_oot_by_class
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.models.utils import extract_layer_index

from afd_mrv2.items import ATTENTION
from afd_mrv2.mrv2.attention.remote import attach
from afd_mrv2.mrv2.attention.standin import RemoteExpertsMethod
from afd_mrv2.mrv2.deployment import admit
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.mrv2.upstream import load_handoff

log = logging.getLogger(__name__)


class AfdRoutedExperts(RoutedExperts):
    """vLLM's ``RoutedExperts``, except on the AFD Attention role; see docs/internals/vllm-roles.md."""

    def _get_quant_method(
        self, prefix: str, quant_config: QuantizationConfig | None, moe_config: FusedMoEConfig
    ) -> FusedMoEMethodBase:
        vllm_config = get_current_vllm_config()
        # config, connector and runtime pair (moe_seam; mrv2 too under the V2 runner), before anything is built
        config = admit(vllm_config)  # section, plugins, runtime pair, support matrix: before any link
        if config is None or config.role != ATTENTION:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        remote = attach(config, max_tokens=vllm_config.scheduler_config.max_num_batched_tokens, handoff=load_handoff())
        layer_index = extract_layer_index(prefix)
        shape = MoeShape(moe_config.hidden_dim, moe_config.experts_per_token, moe_config.num_experts)
        remote.add_layer(layer_index, shape)
        return RemoteExpertsMethod(moe_config, layer_index)


def register_routed_experts() -> str:
    """Register :class:`AfdRoutedExperts` as vLLM's ``RoutedExperts`` replacement, once per process.

    Idempotent and never raises for a registry it does not own: returns
    ``"registered"``, ``"already registered"``, or ``"owned by <class>"`` when
    another plugin replaced ``RoutedExperts`` first (then afd-mrv2 stays out of its way).
    """
    current = maybe_get_oot_by_class(RoutedExperts)  # upstream's own read-only lookup
    if current is AfdRoutedExperts:
        return "already registered"
    if current is not RoutedExperts:
        return f"owned by {current.__module__}.{current.__qualname__}"
    RoutedExperts.register_oot(AfdRoutedExperts)  # key: the class name "RoutedExperts"
    return "registered"
