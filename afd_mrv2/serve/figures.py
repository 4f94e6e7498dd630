"""Every role's live figures as node 0's serve sees them: read back from the rendezvous store.

Each role publishes its own record there every second, from any node
(:class:`afd_mrv2.live_stats.FiguresPublisher`, ``RendezvousStore.publish_live``); :class:`FiguresReader`
reads every role rank's every :data:`LOOK_S` in one store call, off serve's loop
(:meth:`~afd_mrv2.serve.rendezvous.RendezvousHost.call`), and keeps the latest for ``/metrics``,
``/afd/status`` and the stall watch.  A record the codec refuses is left out, logged once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from afd_mrv2.live_stats import FiguresError, Written, decode
from afd_mrv2.serve.rendezvous import RendezvousHost

#: How often serve reads the roles' figures (each role publishes every second).
LOOK_S = 0.5


class FiguresReader:
    """The latest figures of ``ranks`` (``(role, rank)`` pairs), read from ``rendezvous``'s store."""

    def __init__(
        self, rendezvous: RendezvousHost, ranks: Sequence[tuple[str, int]], say: Callable[[str], None]
    ) -> None:
        self.rendezvous = rendezvous
        self.ranks = tuple(ranks)
        self.say = say
        self._latest: dict[tuple[str, int], Written] = {}
        self._refused: set[str] = set()

    def figures(self) -> dict[tuple[str, int], Written]:
        """``{(role, rank): written}`` as last read (a rank that never published is absent)."""
        return dict(self._latest)

    async def run(self) -> None:
        ranks = self.ranks
        while True:
            docs = await self.rendezvous.call(lambda s: {k: s.live(*k) for k in ranks})
            for key, doc in (docs or {}).items():
                if doc is not None:
                    self._take(key, doc)
            await asyncio.sleep(LOOK_S)

    def _take(self, key: tuple[str, int], doc: dict[str, Any]) -> None:
        try:
            self._latest[key] = decode(key[0], doc, where=f"{key[0]} {key[1]}")
        except FiguresError as exc:
            if str(exc) not in self._refused:
                self._refused.add(str(exc))
                self.say(f"live figures left out: {exc}")
