"""Two PeerLinks of 1A1F in this process on a real loopback pair (zmq or tcp), for the hooks' tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from afd_mrv2.hooks.p2p import tcp_channel, zmq_channel
from afd_mrv2.hooks.p2p.link import Pair, PeerLink
from afd_mrv2.topology import Topology

#: the loopback pair of each transport: (connecting side, listening side)
LOOPBACK = {"zmq": zmq_channel.loopback_pair, "tcp": tcp_channel.loopback_pair}


@contextmanager
def channel_links(topology: Topology, kind: str) -> Iterator[tuple[PeerLink, PeerLink]]:
    """(Attention rank 0's link, FFN rank 0's link; global ranks 0 and 1) on one ``kind`` pair (``"zmq"`` or
    ``"tcp"``) named ``a0.1-f0.1``, released on exit."""
    attention_end, ffn_end = LOOPBACK[kind](name="a0.1-f0.1")
    attention = PeerLink(topology, 0, pairs={1: Pair(attention_end, 0, 1, "a0.1-f0.1")})
    ffn = PeerLink(topology, 1, pairs={0: Pair(ffn_end, 1, 0, "a0.1-f0.1")})
    try:
        yield attention, ffn
    finally:
        for link in (attention, ffn):
            link.release()
