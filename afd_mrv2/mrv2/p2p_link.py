"""The process group torch_p2p runs on when AFD roles are vLLM processes.

A vLLM worker already owns torch.distributed's default group (its own TP/PP/DP
groups), so the AFD link must not touch it.  Each role process builds a group of
its own instead: a :class:`torch.distributed.TCPStore` on ``afd.host:afd.port``
and a gloo process group on a prefixed view of that store, then wraps it in the
:class:`~afd_mrv2.hooks.p2p.link.PeerLink` the torch_p2p connector needs as its
``p2p_link`` resource.  vLLM's groups are never read or changed.

Global ranks follow :class:`~afd_mrv2.topology.Topology` (attention ranks first,
then FFN ranks).  FFN rank 0 hosts the store (it starts first: the Attention
engine's warm-up forward already reaches the FFN, see docs/vllm.md); the other
ranks connect as clients and retry until ``connect_timeout_s``.

Faults are scoped to the peers a wait is on (``PeerLink(scoped=True)``): an
Attention engine that dies ends only the FFN ranks' loops serving it, and the other
engines go on.

Timeouts: a serving FFN rank waits for the next item as long as its Attention
engines stay idle, so the group's own timeout (on expiry gloo aborts the whole
group, not one wait) is set to ``idle_timeout_s`` (default one week).  Dead
peers are still noticed at once through PeerLink's control channel, and stalled
ones through the connector's ``recv_timeout_s`` / ``send_timeout_s`` where a
reply is due.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from afd_mrv2.hooks.p2p import PeerLink
from afd_mrv2.topology import FFN, Topology

STORE_PREFIX = "afd_mrv2/p2p"
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


def store_master(topology: Topology) -> int:
    """The global rank that hosts the TCPStore: FFN rank 0."""
    return topology.global_rank(FFN, 0)


def open_peer_link(
    topology: Topology,
    rank: int,
    *,
    host: str,
    port: int,
    connect_timeout_s: float = 600.0,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> PeerLink:
    """Join the AFD group as global ``rank`` and return its :class:`PeerLink`.

    Blocks until every rank of ``topology`` joined (gloo's rendezvous) or
    ``connect_timeout_s`` passed.
    """
    store = dist.TCPStore(
        host,
        port,
        world_size=topology.world_size,
        is_master=rank == store_master(topology),
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
