"""Deprecated path of :mod:`afd_mrv2.mrv2.attention.worker` (``--worker-cls afd_mrv2.mrv2.worker.AfdWorker``)."""

from __future__ import annotations

from typing import Any

from afd_mrv2.mrv2._moved import warn_moved

_NEW = "afd_mrv2.mrv2.attention.worker"


def __getattr__(name: str) -> Any:
    if name not in ("AfdWorker", "AfdCPUWorker"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_moved(f"{__name__}.{name}", f"{_NEW}.{name}")
    from afd_mrv2.mrv2.attention import worker

    return getattr(worker, name)
