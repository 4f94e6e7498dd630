"""Attention role on vLLM-Ascend: vllm-ascend's routed-experts layer whose routed compute is the AFD transfer.

:func:`install_attention_layer` (the worker calls it once vllm-ascend registered its ops),
:func:`attention_layer_class`, :class:`AscendRemoteExpertsMethod`.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.platforms.ascend" and RFC 0005 §3.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.models.utils import extract_layer_index
from vllm_ascend.ops.fused_moe.moe_comm_method import FusedExpertsResult

from afd_mrv2.compat.registry import RegistryRefused, replace_oot_layer
from afd_mrv2.errors import ConfigError
from afd_mrv2.items import ATTENTION
from afd_mrv2.mrv2.attention.remote import attach
from afd_mrv2.mrv2.attention.standin import RemoteExpertsMethod
from afd_mrv2.mrv2.deployment import admit
from afd_mrv2.mrv2.shape import MoeShape

#: the out-of-tree registry key vllm-ascend's ``register_ascend_customop`` fills (``vllm_ascend/utils.py``)
NAME = "RoutedExperts"
#: the classes it registers under :data:`NAME`: the default one, and the 310P one (``_310p/fused_moe``)
REGISTERED = (
    "vllm_ascend.ops.fused_moe.routed_experts.AscendRoutedExperts",
    "vllm_ascend._310p.fused_moe.fused_moe.AscendRoutedExperts310",
)


class AscendRemoteExpertsMethod(RemoteExpertsMethod):
    """The routed compute of vllm-ascend's ``forward_impl`` as one AFD round trip (``RemoteExpertsMethod``'s)."""

    def apply(
        self,
        layer: Any,
        x: Any,
        topk_weights: Any,
        topk_ids: Any,
        shared_experts: Any,
        shared_experts_input: Any,
    ) -> Any:
        """``FusedExpertsResult(routed_out=...)``, no events: nothing is dispatched or combined on this rank.

        vllm-ascend's ``forward_impl`` passes no shared experts (its ``AscendMoERunner`` runs them).
        """
        del layer, shared_experts, shared_experts_input
        return FusedExpertsResult(routed_out=self.routed(x, topk_weights, topk_ids))

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        """False: on Ascend ``apply`` runs no shared experts."""
        return False


def check_unit_layout(moe_config: Any) -> None:
    """Refuse a MoE layout whose groups the Ascend path would reduce the transfer's whole answer over: the
    ``FusedMoEConfig`` sizes must be 1, since the answer is the whole routed output (RFC 0005 §3, "open points")."""
    sizes = {
        "tp_size": moe_config.tp_size,
        "dp_size": moe_config.dp_size,
        "ep_size": moe_config.ep_size,
        "pcp_size": moe_config.pcp_size,
    }
    over = {name: int(size) for name, size in sizes.items() if int(size) != 1}
    if over:
        got = ", ".join(f"{name}={size}" for name, size in over.items())
        raise ConfigError(
            "afd.role",
            f"the Attention role on vLLM-Ascend needs MoE tp/dp/ep/pcp sizes of 1 (the routed output it receives "
            f"is whole; vllm-ascend would sum it again across those groups); got {got}",
        )


def remote_experts_method(prefix: str, moe_config: Any) -> AscendRemoteExpertsMethod | None:
    """This layer's AFD quant method when this process is an admitted Attention role, else None."""
    vllm_config = get_current_vllm_config()
    config = admit(vllm_config)  # the one admission call, before any link
    if config is None or config.role != ATTENTION:
        return None
    check_unit_layout(moe_config)
    # no micro-batch hand-off: vLLM-Ascend runs no micro-batching (RFC 0005 §4)
    remote = attach(config, max_tokens=vllm_config.scheduler_config.max_num_batched_tokens, handoff=None)
    layer_index = extract_layer_index(prefix)
    remote.add_layer(layer_index, MoeShape(moe_config.hidden_dim, moe_config.experts_per_token, moe_config.num_experts))
    return AscendRemoteExpertsMethod(moe_config, layer_index)


#: ``(prefix, moe_config) -> AscendRemoteExpertsMethod | None``: the layer's AFD quant method, or None (not AFD)
MethodFactory = Callable[[str, Any], "AscendRemoteExpertsMethod | None"]


@functools.cache
def attention_layer_class(registered: type, method_factory: MethodFactory = remote_experts_method) -> type:
    """``registered`` (the class vllm-ascend registered) whose quant method is ``method_factory``'s.

    Everything else is ``registered``'s: its router, expert map, comm prepare/finalize, shared-expert
    milestones and ``forward_impl``.  The method is installed where the weights are created
    (``_get_quant_method``: placeholders, no expert weight) and again after ``registered.__init__``,
    which installs its own unquantized method once the weights exist.
    """

    def _get_quant_method(self: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        method = method_factory(prefix, moe_config)
        if method is None:
            return super(cls, self)._get_quant_method(prefix, quant_config, moe_config)
        self._afd_method = method
        return method

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        super(cls, self).__init__(*args, **kwargs)
        method = self._afd_method
        if method is not None and self.quant_method is not method:
            # the platform's unquantized method is a CustomOp: a child module, which only a module may replace
            del self.quant_method
            self._replace_quant_method(method)  # upstream's setter, on this instance

    namespace = {
        "__module__": __name__,
        "__doc__": f"{registered.__qualname__} whose routed compute is the AFD transfer (afd-mrv2).",
        "_afd_method": None,
        "__init__": __init__,
        "_get_quant_method": _get_quant_method,
    }
    cls: type[Any] = type("AfdAscendRoutedExperts", (registered,), namespace)
    return cls


def _qualified(cls: object) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)


def install_attention_layer() -> str:
    """Replace vllm-ascend's ``RoutedExperts`` entry by :func:`attention_layer_class` over it (once per process).

    Call after ``register_ascend_customop`` (``NPUWorker.__init__``) and before the model is built.
    """
    current = op_registry_oot.get(NAME)
    over = current.__bases__[0] if isinstance(current, type) and current.__bases__ else None
    if _qualified(over) in REGISTERED and current is attention_layer_class(over):
        return f"already installed over {_qualified(over)}"
    if _qualified(current) not in REGISTERED:
        found = "nothing" if current is None else _qualified(current)
        raise RegistryRefused(f"out-of-tree layer {NAME!r}: expected one of {', '.join(REGISTERED)}, found {found}")
    assert isinstance(current, type)
    replace_oot_layer(NAME, current, attention_layer_class(current), registry=op_registry_oot)
    return f"installed over {_qualified(current)}"
