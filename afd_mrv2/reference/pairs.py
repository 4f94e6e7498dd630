"""The embedded run's link on zmq or tcp pairs (``afd-mrv2 run --transport``; gloo keeps one group).

Every Attention rank joins one pair with every FFN rank through
:meth:`~afd_mrv2.mrv2.transport.store.RendezvousStore.join_pair`, the handshake the vLLM roles use,
on the store that also starts torch.distributed (``MASTER_ADDR``/``MASTER_PORT``).  Every process takes
its pairs in one order (Attention index, then FFN index), so the smallest unjoined pair always has both
sides at it: no process waits on a peer that waits on another.  Each rank is its first incarnation, and
the link is unscoped as on gloo's one group (a dead peer fails every wait).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch.distributed as dist

from afd_mrv2.errors import AfdError
from afd_mrv2.hooks.p2p import Pair, PeerLink
from afd_mrv2.mrv2.transport.store import PairTransport, RendezvousStore
from afd_mrv2.topology import ATTENTION, Topology

INCARNATION = 1  # the embedded run has no restarts


def open_pair_link(
    topology: Topology,
    rank: int,
    store: dist.Store,
    transport: PairTransport,
    *,
    labels: Mapping[int, str],
    timeout_s: float,
) -> PeerLink:
    """This rank's PeerLink on one ``transport`` pair per rank of the other role; :class:`AfdError` naming the
    pair that had not joined when ``timeout_s`` (for them all) ran out."""
    role, index = topology.role_of(rank)
    rendezvous = RendezvousStore(store, transport=transport)
    stamp = topology.placement.stamp
    pairs: dict[int, Pair] = {}
    deadline = time.monotonic() + timeout_s
    for peer in topology.peers_of(rank):  # ascending: Attention index, then FFN index, on both sides
        other = topology.role_of(peer)[1]
        a, f = (index, other) if role == ATTENTION else (other, index)
        pair = rendezvous.join_pair(
            role, (a, INCARNATION), (f, INCARNATION), placement=stamp, give_up=lambda: time.monotonic() > deadline
        )
        if pair is None:
            raise AfdError(
                f"{topology.describe(rank)}: its {transport.kind} pair with {topology.describe(peer)} did not join "
                f"within {timeout_s:g} s"
            )
        pairs[peer] = pair
    # unscoped, as on the one gloo group: one dead peer fails every wait (the embedded run's rule)
    return PeerLink(topology, rank, labels=labels, pairs=pairs, scoped=False)
