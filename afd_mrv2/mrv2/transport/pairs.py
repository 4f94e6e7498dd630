"""The links torch_p2p runs on when AFD roles are vLLM processes: one pair (a channel) per Attention-FFN pair.

See docs/internals/p2p-transport.md, "afd_mrv2.mrv2.transport.pairs".
"""

from __future__ import annotations

import logging
import threading
import time

from afd_mrv2.config import AfdConfig
from afd_mrv2.hooks.p2p import Pair, PeerLink
from afd_mrv2.items import ATTENTION
from afd_mrv2.mrv2.transport.store import POLL_S, PREFIX, PairTransport, RendezvousStore
from afd_mrv2.placement import PlacementStamp
from afd_mrv2.topology import FFN, Topology

log = logging.getLogger(__name__)
#: How often an Attention engine waiting at its first rendezvous says for which FFN rank.
WAITING_SAY_S = 30.0


def open_attention_link(
    store: RendezvousStore, topology: Topology, index: int, *, connect_timeout_s: float = 600.0
) -> tuple[PeerLink, int, dict[int, int]]:
    """Register Attention rank ``index`` and join a pair with every FFN rank's latest incarnation (each
    registers before it serves; waits up to ``connect_timeout_s`` for one that has not yet, following a
    restarted one).  An FFN rank whose latest incarnation is marked lost
    (:meth:`~afd_mrv2.mrv2.transport.store.RendezvousStore.mark_lost`) gets no pair: the link has none with
    it until a rejoin.  Each pair's handshake compares the two sides' placement tables (``topology``'s here).  Returns the link, this incarnation, and each FFN rank's incarnation joined (or
    skipped as lost)."""
    me = store.register(ATTENTION, index)
    deadline = time.monotonic() + connect_timeout_s
    pairs: dict[int, Pair] = {}
    joined: dict[int, int] = {}
    labels = {topology.global_rank(ATTENTION, index): store.label(ATTENTION, index, me)}
    for f in range(topology.num_ffn):
        joined[f], pair = _join_ffn(store, (index, me), f, topology.placement.stamp, deadline, connect_timeout_s)
        if pair is not None:
            peer = topology.global_rank(FFN, f)
            pairs[peer], labels[peer] = pair, store.label(FFN, f, joined[f])
    return PeerLink(topology, topology.global_rank(ATTENTION, index), pairs=pairs, labels=labels), me, joined


def _join_ffn(
    store: RendezvousStore,
    attention: tuple[int, int],
    f: int,
    placement: PlacementStamp,
    deadline: float,
    connect_timeout_s: float,
) -> tuple[int, Pair | None]:
    """(FFN rank ``f``'s incarnation, the pair joined with it), or (that incarnation, None) when it is marked
    lost; follows a newer incarnation that registers meanwhile."""
    say_at = time.monotonic() + WAITING_SAY_S
    while True:
        j = store.latest(FFN, f)
        now = time.monotonic()
        if not j and now >= say_at:
            say_at = now + WAITING_SAY_S
            waited = connect_timeout_s - (deadline - now)
            log.warning(
                "attention rank %d: FFN rank %d has not registered in the rendezvous store yet (%.0f s of %g s)",
                attention[0],
                f,
                waited,
                connect_timeout_s,
            )
        if now > deadline:
            raise TimeoutError(
                f"attention rank {attention[0]}: FFN rank {f} did not {'register' if not j else 'join'} within "
                f"{connect_timeout_s:g} s (store {PREFIX} on the AFD port)"
            )
        if not j:
            time.sleep(POLL_S)
            continue
        if store.lost_incarnation(FFN, f) == j:  # gone, not back yet: the rejoiner takes it when it is
            return j, None

        def newer(j: int = j) -> bool:
            return store.latest(FFN, f) != j or time.monotonic() > deadline

        pair = store.join_pair(ATTENTION, attention, (f, j), placement=placement, give_up=newer)
        if pair is not None:
            return j, pair


class AttentionLinkOpening:
    """:func:`open_attention_link` on a thread of its own (started at construction), so that an Attention
    engine's rendezvous runs while vLLM still builds and loads the model, never on the model's thread,
    which only waits in :meth:`wait` at its first transfer if the link is not open by then."""

    def __init__(self, config: AfdConfig, topology: Topology) -> None:
        """Open the link of Attention rank ``config.rank`` on the store at ``config.host:config.port``, its
        pairs on ``afd.transport``."""
        self._result: tuple[RendezvousStore, PeerLink, int, dict[int, int]] | None = None
        #: the store, once reached (the link may still be opening)
        self.store: RendezvousStore | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._open, args=(config, topology), name=f"afd-open-attention{config.rank}", daemon=True
        )
        self._thread.start()

    def _open(self, config: AfdConfig, topology: Topology) -> None:
        try:
            store = self.store = RendezvousStore.connect(
                config.host,
                config.port,
                master=False,
                timeout_s=config.join_timeout_s,
                transport=PairTransport.of(config),
            )
            link = open_attention_link(store, topology, config.rank, connect_timeout_s=config.join_timeout_s)
            self._result = (store, *link)
        except BaseException as exc:  # noqa: BLE001 - raised on the waiting thread by wait()
            self._error = exc

    def wait(self) -> tuple[RendezvousStore, PeerLink, int, dict[int, int]]:
        """(the store, the link, this incarnation, each FFN rank's incarnation joined); what opening raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
