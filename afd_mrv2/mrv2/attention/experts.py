"""The MoE seam: afd-mrv2's out-of-tree replacement of vLLM's ``RoutedExperts`` layer.

:class:`AfdRoutedExperts`, installed by :func:`register_routed_experts`.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.attention.experts".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import maybe_get_oot_by_class
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.models.utils import extract_layer_index

from afd_mrv2.errors import ConfigError
from afd_mrv2.items import ATTENTION
from afd_mrv2.mrv2.attention.remote import attach
from afd_mrv2.mrv2.attention.rows import RowShare
from afd_mrv2.mrv2.attention.standin import RemoteExpertsMethod
from afd_mrv2.mrv2.deployment import admit
from afd_mrv2.mrv2.held import HeldExpertMap, role_held_set
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.mrv2.upstream import load_handoff, load_padding_mask

log = logging.getLogger(__name__)


class AfdRoutedExperts(RoutedExperts):
    """vLLM's ``RoutedExperts`` holding the role's experts (none on the Attention role, where the layer's method
    sends to the FFN ranks; ``afd.placement``'s share on an FFN rank); see docs/internals/vllm-roles.md."""

    def __init__(
        self,
        layer_name: str,
        params_dtype: torch.dtype,
        moe_config: FusedMoEConfig,
        quant_config: QuantizationConfig | None,
        expert_map_manager: ExpertMapManager,
        **kwargs: Any,
    ) -> None:
        # config, connector and runtime pair (moe_seam; mrv2 too under the V2 runner), before anything is built
        config = admit(get_current_vllm_config())  # section, plugins, runtime pair, support matrix: before any link
        self.afd_attention = config if config is not None and config.role == ATTENTION else None
        #: the global ids of the experts this layer holds (None: no afd section, upstream's layer)
        self.afd_held: tuple[int, ...] | None = None
        if config is not None:  # a held set: every other expert maps to -1, is never allocated, and is skipped on load
            _refuse_held_set(layer_name, config.role, moe_config, expert_map_manager)
            self.afd_held = role_held_set(config, moe_config.num_experts)
            expert_map_manager = HeldExpertMap(expert_map_manager, held=self.afd_held)
            if self.afd_attention is None:  # FFN rank: the real method allocates exactly its held experts (the
                # layer's own copy of the config: the factory's object, which its runner keeps, stays upstream's)
                moe_config = dataclasses.replace(moe_config, num_local_experts=len(self.afd_held))
            # the Attention role's moe_config keeps the factory's num_local_experts: the real method is built as
            # on plain vLLM (its backend choice included); the stand-in's create_weights allocates 0 experts
        super().__init__(layer_name, params_dtype, moe_config, quant_config, expert_map_manager, **kwargs)

    @property
    def expert_map(self) -> torch.Tensor | None:
        """None on an FFN rank: its kernel sees local ids (the FFN server maps global ids onto the held experts'
        positions), so a kernel that honours ``expert_map`` must not translate them a second time."""
        if self.afd_held is not None and self.afd_attention is None:
            return None
        expert_map: torch.Tensor | None = super().expert_map
        return expert_map

    def _get_quant_method(
        self, prefix: str, quant_config: QuantizationConfig | None, moe_config: FusedMoEConfig
    ) -> FusedMoEMethodBase:
        config = self.afd_attention
        if config is None:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        try:  # the method this checkpoint's experts would use: its create_weights names the placeholders
            real = super()._get_quant_method(prefix, quant_config, moe_config)
        except (NotImplementedError, ValueError, RuntimeError) as exc:
            raise ConfigError(
                "afd.role",
                f"{prefix}: the Attention role builds the checkpoint's routed-experts quant method for its "
                f"parameter names, and it cannot be built here ({type(exc).__name__}: {exc})",
            ) from exc
        vllm_config = get_current_vllm_config()
        parallel = vllm_config.parallel_config
        share = RowShare(
            parallel.tensor_parallel_size, parallel.rank % parallel.tensor_parallel_size, load_padding_mask()
        )
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        remote = attach(config, max_tokens=max_tokens, handoff=load_handoff(), share=share)
        layer_index = extract_layer_index(prefix)
        shape = MoeShape(moe_config.hidden_dim, moe_config.experts_per_token, moe_config.num_experts)
        remote.add_layer(layer_index, shape)
        return RemoteExpertsMethod(moe_config, layer_index, real)


def _refuse_held_set(layer_name: str, role: str, moe_config: FusedMoEConfig, manager: ExpertMapManager) -> None:
    """One line for what a held set cannot express: EPLB, EP across ranks, fused shared experts."""
    parallel = moe_config.moe_parallel_config
    refused = (
        "EPLB (enable_eplb)" if parallel.enable_eplb else None,
        f"expert parallelism across {parallel.ep_size} ranks" if parallel.use_ep and parallel.ep_size > 1 else None,
        f"{manager.num_fused_shared_experts} fused shared experts" if manager.num_fused_shared_experts else None,
    )
    reasons = [r for r in refused if r is not None]
    if reasons:
        holds = "holds no routed expert" if role == ATTENTION else "holds the routed experts afd.placement gives it"
        raise ConfigError(
            "afd.role",
            f"the {role} role {holds}, but {layer_name} asks for {' and '.join(reasons)}; "
            f"run the {role} engine without it",
        )


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
