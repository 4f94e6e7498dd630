"""The Attention role's platform table: platform -> the adapter that installs its routed-experts layer.

:func:`attention_adapter`; a platform absent here keeps afd-mrv2's general plugin (``AfdRoutedExperts``).

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.platforms".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class AttentionAdapter(Protocol):
    """What a platform's Attention adapter module offers the worker."""

    def install_attention_layer(self) -> str:
        """Make the platform's registered routed-experts layer the AFD one; a one-line outcome."""
        ...


def _ascend() -> AttentionAdapter:
    from afd_mrv2.mrv2.platforms.ascend import attention

    return attention


#: platform (:attr:`afd_mrv2.compat.detect.Runtime.platform`) -> its adapter, imported when asked for
ATTENTION_ADAPTERS: dict[str, Callable[[], AttentionAdapter]] = {"ascend": _ascend}


def attention_adapter(platform: str) -> AttentionAdapter | None:
    """The Attention adapter of ``platform``, or None where afd-mrv2's general plugin serves it."""
    load = ATTENTION_ADAPTERS.get(platform)
    return None if load is None else load()
