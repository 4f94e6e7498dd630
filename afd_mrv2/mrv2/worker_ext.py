"""Deprecated path of :mod:`afd_mrv2.mrv2.extension` (``--worker-extension-cls
afd_mrv2.mrv2.worker_ext.AfdWorkerExtension``)."""

from __future__ import annotations

from typing import Any

from afd_mrv2.mrv2._moved import warn_moved


def __getattr__(name: str) -> Any:
    if name != "AfdWorkerExtension":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_moved(f"{__name__}.{name}", f"afd_mrv2.mrv2.extension.{name}")
    from afd_mrv2.mrv2 import extension

    return extension.AfdWorkerExtension
