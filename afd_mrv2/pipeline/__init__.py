"""The shared executor: slots, event edges, failure, trace and schedule model.

Work items and the per-item ``Work`` handle live below this package
(:mod:`afd_mrv2.items`, :mod:`afd_mrv2.work`) so that the device backends and the
hook specs can name them without importing the executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from afd_mrv2.items import PHASES, WorkItem
from afd_mrv2.work import BufferSlot, Work

if TYPE_CHECKING:
    from afd_mrv2.pipeline.executor import CloseReport, Executor

__all__ = ["PHASES", "BufferSlot", "CloseReport", "Executor", "Work", "WorkItem"]


def __getattr__(name: str) -> Any:
    """``Executor`` and ``CloseReport`` on first use: a process that only reads figures (serve, through
    :mod:`afd_mrv2.pipeline.metrics`) never imports torch through the executor."""
    if name in ("CloseReport", "Executor"):
        from afd_mrv2.pipeline import executor

        return getattr(executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
