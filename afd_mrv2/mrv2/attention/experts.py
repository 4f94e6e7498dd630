"""The MoE seam: afd-mrv2's out-of-tree replacement of vLLM's ``RoutedExperts`` layer.

vLLM builds every MoE layer's routed experts as ``RoutedExperts(...)``;
``PluggableLayer.__new__`` looks the class name up in the out-of-tree registry,
so once :func:`register_routed_experts` ran (the general plugin's ``register()``,
in every vLLM process) each of them is an :class:`AfdRoutedExperts`.  The layer
decides what it is while it is constructed, from the current vLLM config's
``additional_config["afd"]`` (vLLM sets the current config while it builds the
model):

* no ``afd`` section, or role ``ffn``: exactly upstream (the only override
  defers to ``super()``; the FFN role serves ``forward_modular`` of these layers);
* with an ``afd`` section of either role, the engine's ``VllmConfig`` is admitted first
  (:func:`~afd_mrv2.mrv2.deployment.admit`: section, plugins, runtime pair, support matrix):
  a refused one fails the model's construction, before any link exists;
* role ``attention``: :class:`~afd_mrv2.mrv2.attention.standin.RemoteExpertsMethod`: no
  routed-expert weights, and each call is one AFD transfer to the FFN role
  (:mod:`afd_mrv2.mrv2.attention.remote`).

The decision is made in ``_get_quant_method`` (called once, from
``RoutedExperts.__init__``, before the weights are created).  That is the one
method overridden; each upstream symbol used is a seam contract in
:mod:`afd_mrv2.compat.seams`.
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
    """vLLM's ``RoutedExperts``, except on the AFD Attention role; see the module docstring."""

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
