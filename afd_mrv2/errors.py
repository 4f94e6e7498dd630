"""The exception types afd-mrv2 raises on purpose.

Every error a user can provoke with bad input derives from :class:`AfdError`,
so callers can tell "you asked for something invalid" apart from bugs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from afd_mrv2.items import WorkItem


class AfdError(Exception):
    """Base class of every error afd-mrv2 raises deliberately."""


class ConfigError(AfdError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    ``key`` is the dotted path of the offending key (``afd.multistream.depth``);
    the message names it together with the accepted values, on one line.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class PluginError(AfdError):
    """A connector or observer cannot be found, loaded or registered."""


class PipelineError(AfdError):
    """The executor stopped: a phase hook failed, or the pipeline was closed.

    ``item`` and ``phase`` identify the work item and phase that failed (None when
    the failure is not tied to one work item).
    """

    def __init__(self, message: str, *, item: WorkItem | None = None, phase: str | None = None) -> None:
        super().__init__(message)
        self.item = item
        self.phase = phase


class PipelineAborted(PipelineError):
    """Raised inside stream waits once the executor has stopped new work.

    Hook implementations that poll for completion see it when they call
    :meth:`Work.raise_if_cancelled`; it is the reason handed to ``on_cleanup``
    for work abandoned at shutdown.
    """
