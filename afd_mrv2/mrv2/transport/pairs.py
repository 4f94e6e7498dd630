"""The links torch_p2p runs on when AFD roles are vLLM processes: one two-rank group per pair.

A vLLM worker already owns torch.distributed's default group (its own TP/PP/DP
groups), so the AFD link must not touch it.  Each role process joins groups of its
own through the rendezvous store on ``afd.host:afd.port``
(:class:`~afd_mrv2.mrv2.transport.store.RendezvousStore`) and wraps them in the
:class:`~afd_mrv2.hooks.p2p.link.PeerLink` the torch_p2p connector needs as its
``p2p_link`` resource.  vLLM's groups are never read or changed.

**One gloo group per (Attention rank, FFN rank) pair**
(:meth:`~afd_mrv2.mrv2.transport.store.RendezvousStore.join_pair`), named by the two
processes' *incarnations* (``a{a}.{i}-f{f}.{j}``), counters in the store each process
bumps when it opens its link.  So a peer that dies touches only its pairs, and a
restarted process (a new incarnation) builds new pairs, never reusing a dead one's.
Item numbering (the wire header's ``seq``) is per pair, from 0.  A side waiting for
its peer never blocks on a peer that is gone: it re-reads the peer's incarnation and
follows a newer one.

The store: with ``afd.rendezvous: ffn0`` (the default) FFN rank 0 hosts it (it starts
first: the Attention engine's warm-up forward already reaches the FFN, docs/vllm.md); with
``external`` someone else does (``afd-mrv2 serve``'s supervisor, which outlives every
role), every role is a client, and restarted roles rejoin: an FFN rank serves each
Attention rank's next incarnation after the last one left, until the store's stop key
is set (:meth:`~afd_mrv2.mrv2.transport.store.RendezvousStore.request_stop`).

Timeouts: a serving FFN rank waits for the next item as long as its Attention
engines stay idle, so each group's own timeout (on expiry gloo aborts the whole
group, not one wait) is ``idle_timeout_s`` (default one week).  Dead peers are still
noticed at once through PeerLink's control channel, and stalled ones through the
connector's ``recv_timeout_s`` / ``send_timeout_s`` where a reply is due.
"""

from __future__ import annotations

import threading
import time

from afd_mrv2.hooks.p2p import Pair, PeerLink
from afd_mrv2.items import ATTENTION
from afd_mrv2.mrv2.transport.store import POLL_S, PREFIX, RendezvousStore
from afd_mrv2.topology import FFN, Topology


def open_attention_link(
    store: RendezvousStore, topology: Topology, index: int, *, connect_timeout_s: float = 600.0
) -> tuple[PeerLink, int, dict[int, int]]:
    """Register Attention rank ``index`` and join a pair with every FFN rank's latest incarnation (each
    registers before it serves; waits up to ``connect_timeout_s`` for one that has not yet, following a
    restarted one).  An FFN rank whose latest incarnation is marked lost
    (:meth:`~afd_mrv2.mrv2.transport.store.RendezvousStore.mark_lost`) gets no pair: the link has none with
    it until a rejoin.  Returns the link, this incarnation, and each FFN rank's incarnation joined (or
    skipped as lost)."""
    me = store.register(ATTENTION, index)
    deadline = time.monotonic() + connect_timeout_s
    pairs: dict[int, Pair] = {}
    joined: dict[int, int] = {}
    labels = {topology.global_rank(ATTENTION, index): store.label(ATTENTION, index, me)}
    for f in range(topology.num_ffn):
        joined[f], pair = _join_ffn(store, (index, me), f, deadline, connect_timeout_s)
        if pair is not None:
            peer = topology.global_rank(FFN, f)
            pairs[peer], labels[peer] = pair, store.label(FFN, f, joined[f])
    return PeerLink(topology, topology.global_rank(ATTENTION, index), pairs=pairs, labels=labels), me, joined


def _join_ffn(
    store: RendezvousStore, attention: tuple[int, int], f: int, deadline: float, connect_timeout_s: float
) -> tuple[int, Pair | None]:
    """(FFN rank ``f``'s incarnation, the pair joined with it), or (that incarnation, None) when it is marked
    lost; follows a newer incarnation that registers meanwhile."""
    while True:
        j = store.latest(FFN, f)
        if time.monotonic() > deadline:
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

        pair = store.join_pair(ATTENTION, attention, (f, j), give_up=newer)
        if pair is not None:
            return j, pair


class AttentionLinkOpening:
    """:func:`open_attention_link` on a thread of its own (started at construction), so that an Attention
    engine's rendezvous runs while vLLM still builds and loads the model, never on the model's thread,
    which only waits in :meth:`wait` at its first transfer if the link is not open by then."""

    def __init__(self, host: str, port: int, topology: Topology, index: int) -> None:
        self._result: tuple[RendezvousStore, PeerLink, int, dict[int, int]] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._open, args=(host, port, topology, index), name=f"afd-open-attention{index}", daemon=True
        )
        self._thread.start()

    def _open(self, host: str, port: int, topology: Topology, index: int) -> None:
        try:
            store = RendezvousStore.connect(host, port, master=False)
            self._result = (store, *open_attention_link(store, topology, index))
        except BaseException as exc:  # noqa: BLE001 - raised on the waiting thread by wait()
            self._error = exc

    def wait(self) -> tuple[RendezvousStore, PeerLink, int, dict[int, int]]:
        """(the store, the link, this incarnation, each FFN rank's incarnation joined); what opening raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
