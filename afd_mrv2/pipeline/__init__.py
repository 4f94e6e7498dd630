"""The shared executor: slots, event edges, failure, trace and schedule model.

Work items and the per-item ``Work`` handle live below this package
(:mod:`afd_mrv2.items`, :mod:`afd_mrv2.work`) so that the device backends and the
hook specs can name them without importing the executor.
"""

from __future__ import annotations

from afd_mrv2.items import PHASES, WorkItem
from afd_mrv2.pipeline.executor import CloseReport, Executor
from afd_mrv2.work import BufferSlot, Work

__all__ = ["PHASES", "BufferSlot", "CloseReport", "Executor", "Work", "WorkItem"]
