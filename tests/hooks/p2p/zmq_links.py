"""Two PeerLinks of 1A1F in this process on a real zmq loopback pair, for the hooks' tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from afd_mrv2.hooks.p2p.link import Pair, PeerLink
from afd_mrv2.hooks.p2p.zmq_channel import loopback_pair
from afd_mrv2.topology import Topology


@contextmanager
def zmq_links(topology: Topology) -> Iterator[tuple[PeerLink, PeerLink]]:
    """(Attention rank 0's link, FFN rank 0's link; global ranks 0 and 1) on one pair named ``a0.1-f0.1``,
    released on exit."""
    attention_end, ffn_end = loopback_pair(name="a0.1-f0.1")
    attention = PeerLink(topology, 0, pairs={1: Pair(attention_end, 0, 1, "a0.1-f0.1")})
    ffn = PeerLink(topology, 1, pairs={0: Pair(ffn_end, 1, 0, "a0.1-f0.1")})
    try:
        yield attention, ffn
    finally:
        for link in (attention, ffn):
            link.release()
