"""The links torch_p2p runs on when AFD roles are vLLM processes: one two-rank group per pair.

A vLLM worker already owns torch.distributed's default group (its own TP/PP/DP
groups), so the AFD link must not touch it.  Each role process builds groups of its
own on a :class:`torch.distributed.TCPStore` at ``afd.host:afd.port`` and wraps them in
the :class:`~afd_mrv2.hooks.p2p.link.PeerLink` the torch_p2p connector needs as its
``p2p_link`` resource.  vLLM's groups are never read or changed.

**One gloo group per (Attention rank, FFN rank) pair** (:func:`join_pair`), on its own
store prefix ``afd_mrv2/p2p/a{a}.{i}-f{f}.{j}``: ``i`` and ``j`` are the two processes'
*incarnations*, counters in the store each process bumps when it opens its link
(:func:`register`).  So a peer that dies touches only its pairs, and a restarted process
(a new incarnation) builds new pairs, never reusing a dead one's.  Item numbering
(the wire header's ``seq``) is per pair, from 0.

Joining a pair is a handshake through the store before gloo's own rendezvous: each side
sets its ``hello`` key for the pair, waits (polling, so it can give up) for the other's,
and only then both enter gloo's rendezvous, which then completes at once.  A side that
waits never blocks on a peer that is gone: it re-reads the peer's incarnation and
follows a newer one.

The store: with ``afd.rendezvous: ffn0`` (the default) FFN rank 0 hosts it (it starts
first: the Attention engine's warm-up forward already reaches the FFN, docs/vllm.md); with
``external`` someone else does (``afd-mrv2 serve``'s supervisor, which outlives every
role), every role is a client, and restarted roles rejoin: an FFN rank serves each
Attention rank's next incarnation after the last one left, until the store's ``stop`` key
is set (:func:`request_stop`).

Timeouts: a serving FFN rank waits for the next item as long as its Attention
engines stay idle, so each group's own timeout (on expiry gloo aborts the whole
group, not one wait) is ``idle_timeout_s`` (default one week).  Dead peers are still
noticed at once through PeerLink's control channel, and stalled ones through the
connector's ``recv_timeout_s`` / ``send_timeout_s`` where a reply is due.

:func:`open_peer_link` (one group of every rank, FFN rank 0 hosting the store) is the
transport before pairs, kept for comparison (``AFD_MRV2_P2P_GROUPS=one``).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from afd_mrv2.hooks.p2p import Pair, PeerLink
from afd_mrv2.items import ATTENTION
from afd_mrv2.topology import FFN, Topology

STORE_PREFIX = "afd_mrv2/p2p"
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
#: How often a side waiting for its peer's hello (or a newer incarnation) looks again.
POLL_S = 0.05
#: How long gloo's own rendezvous of a pair may take once both sides said hello.
PAIR_RENDEZVOUS_S = 60.0
#: ``AFD_MRV2_P2P_GROUPS=one``: the one group of every rank instead of pairs (for comparison only).
GROUPS_ENV = "AFD_MRV2_P2P_GROUPS"
STOP_KEY = f"{STORE_PREFIX}/stop"


def pairs_enabled() -> bool:
    return os.environ.get(GROUPS_ENV, "pairs") != "one"


def connect_store(host: str, port: int, *, master: bool, timeout_s: float = 600.0) -> dist.TCPStore:
    """The rendezvous store on ``host:port``: hosted here (``master``) or connected to (retrying until
    ``timeout_s``)."""
    return dist.TCPStore(
        host, port, is_master=master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _name(role: str, index: int) -> str:
    return f"{'a' if role == ATTENTION else 'f'}{index}"


def register(store: dist.Store, role: str, index: int) -> int:
    """This process as the next incarnation of ``role`` rank ``index`` (1, 2, ...); its label (pid, host)
    goes into the store for the peers' messages."""
    incarnation = int(store.add(f"{STORE_PREFIX}/{_name(role, index)}/incarnation", 1))
    store.set(
        f"{STORE_PREFIX}/{_name(role, index)}.{incarnation}/label", f"pid {os.getpid()} on {socket.gethostname()}"
    )
    return incarnation


def incarnation(store: dist.Store, role: str, index: int) -> int:
    """The latest incarnation of ``role`` rank ``index`` (0: none registered yet); never blocks."""
    return int(store.add(f"{STORE_PREFIX}/{_name(role, index)}/incarnation", 0))


def label(store: dist.Store, role: str, index: int, incarnation: int) -> str:
    key = f"{STORE_PREFIX}/{_name(role, index)}.{incarnation}/label"
    return store.get(key).decode() if store.check([key]) else ""


def mark_lost(store: dist.Store, role: str, index: int) -> None:
    """Say in the store that ``role`` rank ``index``'s latest incarnation is gone (serve, on a loss): a process
    that starts meanwhile (a restarted engine) does not wait for it, and joins its next incarnation later."""
    store.set(f"{STORE_PREFIX}/{_name(role, index)}/lost", str(incarnation(store, role, index)))


def lost_incarnation(store: dist.Store, role: str, index: int) -> int:
    """The incarnation of ``role`` rank ``index`` last marked lost (0: none)."""
    key = f"{STORE_PREFIX}/{_name(role, index)}/lost"
    return int(store.get(key).decode()) if store.check([key]) else 0


def stop_requested(store: dist.Store) -> bool:
    return bool(store.check([STOP_KEY]))


def request_stop(store: dist.Store) -> None:
    """Tell every role on this store that the deployment is stopping: FFN ranks then serve no new
    incarnation (:func:`serve_pairs` ends) once their engines left."""
    store.set(STOP_KEY, "1")


def pair_name(attention: int, attention_inc: int, ffn: int, ffn_inc: int) -> str:
    return f"a{attention}.{attention_inc}-f{ffn}.{ffn_inc}"


def join_pair(
    store: dist.Store,
    role: str,
    attention: tuple[int, int],
    ffn: tuple[int, int],
    *,
    give_up: Callable[[], bool] = lambda: False,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> Pair | None:
    """Join the pair of Attention rank ``attention = (index, incarnation)`` and FFN rank ``ffn`` as ``role``:
    say hello, wait for the peer's hello (None when ``give_up()`` turns true first), then gloo's
    rendezvous of the two.  The Attention rank is rank 0 of the pair."""
    name = pair_name(*attention, *ffn)
    prefix = f"{STORE_PREFIX}/{name}"
    mine, theirs = ("attention", "ffn") if role == ATTENTION else ("ffn", "attention")
    store.set(f"{prefix}/hello/{mine}", "1")
    key = f"{prefix}/hello/{theirs}"
    while not store.check([key]):
        if give_up():
            return None
        time.sleep(POLL_S)
    me = 0 if role == ATTENTION else 1
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(f"{prefix}/gloo", store), me, 2, datetime.timedelta(seconds=idle_timeout_s)
    )
    return Pair(group, me, 1 - me, name)


def store_master(topology: Topology) -> int:
    """The global rank that hosts the TCPStore: FFN rank 0."""
    return topology.global_rank(FFN, 0)


def open_attention_link(
    store: dist.Store, topology: Topology, index: int, *, connect_timeout_s: float = 600.0
) -> tuple[PeerLink, int, dict[int, int]]:
    """Register Attention rank ``index`` and join a pair with every FFN rank's latest incarnation (each
    registers before it serves; waits up to ``connect_timeout_s`` for one that has not yet, following a
    restarted one).  An FFN rank whose latest incarnation is marked lost (:func:`mark_lost`) gets no pair:
    the link has none with it until a rejoin.  Returns the link, this incarnation, and each FFN rank's
    incarnation joined (or skipped as lost)."""
    me = register(store, ATTENTION, index)
    deadline = time.monotonic() + connect_timeout_s
    pairs: dict[int, Pair] = {}
    joined: dict[int, int] = {}
    labels: dict[int, str] = {}
    for f in range(topology.num_ffn):
        pair = None
        while pair is None:
            j = incarnation(store, FFN, f)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"attention rank {index}: FFN rank {f} did not {'register' if not j else 'join'} within "
                    f"{connect_timeout_s:g} s (store {STORE_PREFIX} on the AFD port)"
                )
            if not j:
                time.sleep(POLL_S)
                continue
            if lost_incarnation(store, FFN, f) == j:  # gone, not back yet: the rejoiner takes it when it is
                break

            def newer(f: int = f, j: int = j) -> bool:
                return incarnation(store, FFN, f) != j or time.monotonic() > deadline

            pair = join_pair(store, ATTENTION, (index, me), (f, j), give_up=newer)
        peer = topology.global_rank(FFN, f)
        joined[f] = j
        if pair is not None:
            pairs[peer], labels[peer] = pair, label(store, FFN, f, j)
    labels[topology.global_rank(ATTENTION, index)] = label(store, ATTENTION, index, me)
    return (
        PeerLink(topology, topology.global_rank(ATTENTION, index), pairs=pairs, labels=labels, scoped=True),
        me,
        joined,
    )


class AttentionLinkOpening:
    """:func:`open_attention_link` on a thread of its own (started at construction), so that an Attention
    engine's rendezvous runs while vLLM still builds and loads the model, never on the model's thread,
    which only waits in :meth:`wait` at its first transfer if the link is not open by then."""

    def __init__(self, host: str, port: int, topology: Topology, index: int) -> None:
        self._result: tuple[dist.Store, PeerLink, int, dict[int, int]] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._open, args=(host, port, topology, index), name=f"afd-open-attention{index}", daemon=True
        )
        self._thread.start()

    def _open(self, host: str, port: int, topology: Topology, index: int) -> None:
        try:
            store = connect_store(host, port, master=False)
            self._result = (store, *open_attention_link(store, topology, index))
        except BaseException as exc:  # noqa: BLE001 - raised on the waiting thread by wait()
            self._error = exc

    def wait(self) -> tuple[dist.Store, PeerLink, int, dict[int, int]]:
        """(the store, the link, this incarnation, each FFN rank's incarnation joined); what opening raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def open_peer_link(
    topology: Topology,
    rank: int,
    *,
    host: str,
    port: int,
    connect_timeout_s: float = 600.0,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    ffn0_hosts: bool = True,
) -> PeerLink:
    """Join the AFD group as global ``rank`` and return its :class:`PeerLink`.

    Blocks until every rank of ``topology`` joined (gloo's rendezvous) or
    ``connect_timeout_s`` passed.
    """
    store = dist.TCPStore(
        host,
        port,
        world_size=topology.world_size,
        is_master=ffn0_hosts and rank == store_master(topology),
        timeout=datetime.timedelta(seconds=connect_timeout_s),
        wait_for_workers=False,
    )
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(STORE_PREFIX, store), rank, topology.world_size, datetime.timedelta(seconds=idle_timeout_s)
    )
    label = f"pid {os.getpid()} on {socket.gethostname()}"
    store.set(f"{STORE_PREFIX}/label/{rank}", label)
    labels = {peer: store.get(f"{STORE_PREFIX}/label/{peer}").decode() for peer in range(topology.world_size)}
    # the group holds the store (through the prefix store), so the master's server lives as long as the link
    # scoped: every Attention rank is an independent engine, so a peer's loss fails only the waits on that peer
    return PeerLink(topology, rank, group, labels=labels, scoped=True)
