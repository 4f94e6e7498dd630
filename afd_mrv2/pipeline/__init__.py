"""The shared executor and what it works on.

``Executor`` (in :mod:`afd_mrv2.pipeline.executor`) is imported lazily here so that
``afd_mrv2.devices`` and ``afd_mrv2.plugins`` can import the small modules of this
package without a cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from afd_mrv2.pipeline.work import PHASES, Slot, Work, WorkItem

if TYPE_CHECKING:
    from afd_mrv2.pipeline.executor import CloseReport, Executor

__all__ = ["PHASES", "CloseReport", "Executor", "Slot", "Work", "WorkItem"]


def __getattr__(name: str) -> object:
    if name in ("Executor", "CloseReport"):
        from afd_mrv2.pipeline import executor

        return vars(executor)[name]
    raise AttributeError(f"module 'afd_mrv2.pipeline' has no attribute {name!r}")
