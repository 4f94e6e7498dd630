"""Attention side: start without an FFN rank that is lost, take it back once restarted (pairs on an
external store).

A restarted FFN rank registers as a new incarnation in the rendezvous store and waits
for each Attention rank on a new pair (:mod:`afd_mrv2.mrv2.transport.pairs`).  Here a daemon
thread per Attention process watches the store for the FFN ranks its connector stopped
routing to (``lost()``) and, when one has a newer incarnation, joins that pair: the
rendezvous runs on this thread, never on the model's.  The pair then waits in
:meth:`Rejoiner.take` until the model's next step boundary, where the owner installs it
in the link and the connector routes to the rank again: no step mixes two incarnations of a rank.
The same thread drops from the link an FFN rank serve marked lost (its node silent: a cut link sends
no reset), so that the waits on it fail over at once rather than at ``recv_timeout_s``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from afd_mrv2.api import AttentionFailover
from afd_mrv2.errors import PipelineError
from afd_mrv2.hooks.p2p import Pair, PeerLink
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2.transport.store import PlacementMismatch, RendezvousStore
from afd_mrv2.topology import Topology

#: How often the store is looked at for a restarted FFN rank.
WATCH_S = 0.5


@dataclass(frozen=True)
class Comeback:
    """A pair with a restarted FFN rank, ready to be installed between two steps."""

    ffn: int
    pair: Pair
    label: str


def route_around_missing(link: PeerLink, failover: AttentionFailover | None) -> None:
    """FFN ranks the just-opened ``link`` has no pair with (lost before this engine started; serve marked
    them in the store) are routed around from the first item: ``failover.start_without``; without a connector
    that fails over (:func:`~afd_mrv2.api.failover_of` gave None) a missing rank fails here, naming it."""
    topology = link.topology
    for f in range(topology.num_ffn):
        if topology.global_rank(FFN, f) in link.peers:
            continue
        if failover is None:
            raise PipelineError(f"{link.me}: FFN rank {f} is lost and the connector cannot route around it")
        failover.start_without(f)


class Rejoiner:
    """See the module docstring.  ``joined``: each FFN rank's incarnation this side's pair is with."""

    def __init__(
        self,
        store: RendezvousStore,
        topology: Topology,
        index: int,
        me: int,
        joined: dict[int, int],
        lost: Callable[[], set[int]],
        link: PeerLink | None = None,
    ) -> None:
        self.store = store
        self.topology = topology
        self.index = index
        self.me = me
        self.joined = dict(joined)
        self.lost = lost
        self.link = link
        self._dropped: set[tuple[int, int]] = set()  # (FFN rank, incarnation) dropped from the link
        self._ready: queue.SimpleQueue[Comeback] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._mismatch: PlacementMismatch | None = None  # raised by take(): the restarted rank's table differs
        self._thread = threading.Thread(target=self._watch, name=f"afd-rejoin-attention{index}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_S):
            self._drop_marked_lost()
            for f in sorted(self.lost()):
                try:
                    latest = self.store.latest(FFN, f)
                    if latest <= self.joined.get(f, 0):
                        continue

                    def moved_on(f: int = f, latest: int = latest) -> bool:
                        return self._closed.is_set() or self.store.latest(FFN, f) != latest

                    pair = self.store.join_pair(
                        ATTENTION,
                        (self.index, self.me),
                        (f, latest),
                        placement=self.topology.placement.stamp,
                        give_up=moved_on,
                    )
                except PlacementMismatch as exc:  # no retry can fix it: the model's thread raises it (take)
                    self._mismatch = exc
                    return
                except Exception:  # noqa: BLE001 - the store is gone (serve stops) or gloo failed: look again later
                    continue
                if pair is not None:
                    self.joined[f] = latest
                    self._ready.put(Comeback(f, pair, self.store.label(FFN, f, latest)))

    def _drop_marked_lost(self) -> None:
        """The FFN ranks whose incarnation this side holds a pair with and serve marked lost: lost in the link."""
        if self.link is None:
            return
        held = set(self.link.peers)
        for f, j in list(self.joined.items()):
            peer = self.topology.global_rank(FFN, f)
            if (f, j) in self._dropped or peer not in held:
                continue
            try:
                marked = self.store.lost_incarnation(FFN, f) == j
            except Exception:  # noqa: BLE001 - the store is gone (serve stops): nothing to learn
                return
            if marked:
                self._dropped.add((f, j))
                self.link.lose(
                    peer,
                    f"the deployment's serve marked it lost (its process or its node is gone) [incarnation {j}]",
                )

    def take(self) -> list[Comeback]:
        """The pairs joined since the last call (call it between two steps); a restarted FFN rank whose placement
        table differs from this side's raises :class:`~afd_mrv2.mrv2.transport.store.PlacementMismatch` here."""
        if self._mismatch is not None:
            raise self._mismatch
        out = []
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                return out

    def take_back(self, link: PeerLink, failover: AttentionFailover) -> None:
        """Between two steps (nothing in flight): install the pairs joined meanwhile in ``link`` and let the
        connector's ``failover`` route to those FFN ranks again."""
        for comeback in self.take():
            link.install(self.topology.global_rank(FFN, comeback.ffn), comeback.pair, comeback.label)
            failover.take_back(comeback.ffn)

    def close(self) -> None:
        self._closed.set()
