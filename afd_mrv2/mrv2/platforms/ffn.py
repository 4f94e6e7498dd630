"""The FFN role's platform table: platform -> the adapter that computes the routed experts with the platform's layer.

:func:`ffn_adapter`; a platform absent here computes with vLLM's ``forward_modular``.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.platforms".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from afd_mrv2.mrv2.ffn.server import ExpertsFn


class FfnAdapter(Protocol):
    """What a platform's FFN adapter module offers the FFN role's extension."""

    def check_held(self, held: Sequence[int], num_experts: int) -> None:
        """Refuse a share of the experts this platform's compute cannot serve (before any weight is cut)."""
        ...

    def routed_experts_fn(self, layer: Any, vllm_config: Any) -> ExpertsFn:
        """``layer``'s routed experts as the FFN loop calls them, computed by the platform's own quant method."""
        ...


def _ascend() -> FfnAdapter:
    from afd_mrv2.mrv2.platforms.ascend import ffn

    return ffn


#: platform (:attr:`afd_mrv2.compat.detect.Runtime.platform`) -> its adapter, imported when asked for
FFN_ADAPTERS: dict[str, Callable[[], FfnAdapter]] = {"ascend": _ascend}


def ffn_adapter(platform: str) -> FfnAdapter | None:
    """The FFN adapter of ``platform``, or None where vLLM's ``forward_modular`` serves it."""
    load = FFN_ADAPTERS.get(platform)
    return None if load is None else load()
