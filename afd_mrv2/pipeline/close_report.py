"""What an executor's ``close`` (or a failure) left behind, and the failure it records."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from afd_mrv2.errors import PipelineError
from afd_mrv2.items import WorkItem
from afd_mrv2.work import Work

log = logging.getLogger("afd_mrv2.pipeline.executor")  # the executor's own messages


@dataclass
class CloseReport:
    """What ``close`` (or a failure) left behind."""

    abandoned: list[WorkItem] = field(default_factory=list)
    abandoned_streams: dict[str, str] = field(default_factory=dict)
    error: BaseException | None = None

    @property
    def clean(self) -> bool:
        return not self.abandoned and not self.abandoned_streams and self.error is None

    def describe(self) -> str:
        if self.clean:
            return "closed cleanly"
        parts = []
        if self.error is not None:
            parts.append(f"error: {self.error}")
        if self.abandoned:
            parts.append("abandoned work items: " + "; ".join(str(i) for i in self.abandoned))
        if self.abandoned_streams:
            parts.append("abandoned streams: " + "; ".join(f"{k} ({v})" for k, v in self.abandoned_streams.items()))
        return ", ".join(parts)


@dataclass(frozen=True)
class Failure:
    error: BaseException
    item: WorkItem | None
    phase: str | None

    def as_error(self) -> PipelineError:
        """The :class:`PipelineError` the executor raises for this failure, naming the item and phase."""
        where = f"on_{self.phase} failed for work item {self.item}" if self.item else "the pipeline failed"
        return PipelineError(f"{where}: {type(self.error).__name__}: {self.error}", item=self.item, phase=self.phase)


def clean_up(on_cleanup: Callable[..., object], abandoned: Iterable[Work], reason: BaseException) -> None:
    """``on_cleanup`` once for every abandoned item, in issue order; an exception is logged and swallowed."""
    for work in abandoned:
        try:
            on_cleanup(work=work, error=reason)
        except Exception:
            log.exception("on_cleanup raised for %s; continuing", work.item)
