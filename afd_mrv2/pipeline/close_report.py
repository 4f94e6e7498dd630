"""What an executor's ``close`` (or a failure) left behind, and the failure it records."""

from __future__ import annotations

from dataclasses import dataclass, field

from afd_mrv2.items import WorkItem


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
