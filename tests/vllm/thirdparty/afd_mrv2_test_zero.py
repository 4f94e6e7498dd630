"""TEST ONLY: a ``vllm.general_plugins`` plugin whose routed-experts layers contribute zeros.

tests/vllm uses it to prove its checkpoints are sensitive to the MoE output (a run with it must
differ from plain vLLM).  It is installed only into the runs that ask for it (its own dist-info on
``PYTHONPATH``, ``VLLM_PLUGINS=afd_mrv2_test_zero`` so no other general plugin loads there); the
product has no switch for it.
"""

from __future__ import annotations

import torch


def register() -> None:
    from vllm.model_executor.custom_op import maybe_get_oot_by_class
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.models.utils import extract_layer_index

    from afd_mrv2.mrv2.attention.standin import WeightlessExpertsMethod

    class ZeroExpertsMethod(WeightlessExpertsMethod):
        """Routed experts that contribute nothing."""

        def routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
            del topk_weights, topk_ids
            return torch.zeros_like(x)

    class ZeroRoutedExperts(RoutedExperts):
        def _get_quant_method(self, prefix, quant_config, moe_config):  # type: ignore[no-untyped-def]
            return ZeroExpertsMethod(moe_config, extract_layer_index(prefix))

    if maybe_get_oot_by_class(RoutedExperts) is RoutedExperts:  # once per process
        RoutedExperts.register_oot(ZeroRoutedExperts)
