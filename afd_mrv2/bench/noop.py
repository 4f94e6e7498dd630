"""The no-op connector ``afd-mrv2 bench`` measures executor overhead with.

Its phases transfer nothing; each only counts its call (one integer increment,
made by the one thread that runs that phase), so a measurement can prove that
every item it timed went through every hook.
"""

from __future__ import annotations

from afd_mrv2.hookspecs import hookimpl
from afd_mrv2.items import PHASES
from afd_mrv2.work import Work


class NoopConnector:
    """A connector whose phases do nothing but count their calls (``calls[phase]``)."""

    hook_api_version = 1

    def __init__(self) -> None:
        self.calls: dict[str, int] = dict.fromkeys(PHASES, 0)

    @hookimpl
    def on_recv(self, work: Work) -> None:
        self.calls["recv"] += 1

    @hookimpl
    def on_compute(self, work: Work) -> None:
        self.calls["compute"] += 1

    @hookimpl
    def on_send(self, work: Work) -> None:
        self.calls["send"] += 1
