"""Two PeerLinks of 1A1F in this process on a real loopback pair (zmq or tcp), for the hooks' tests, and the
channel tests' helpers (wait, send, recv, value)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from afd_mrv2.hooks.p2p import tcp_channel, zmq_channel
from afd_mrv2.hooks.p2p.channel import Channel, Pending
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


def wait(channel: Channel, pending: Pending, timeout_s: float = 30.0) -> Pending:
    """Wait for ``pending`` through ``channel`` in slices, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not channel.await_done(pending, 0.05):
        assert time.monotonic() < deadline, f"{pending.what} not done within {timeout_s} s"
    return pending


def send(channel: Channel, tag: int, value: float, n: int = 4) -> Pending:
    """``n`` floats of ``value`` under ``tag``; small, so done on return (copied into zmq, taken by the kernel)."""
    pending = channel.post("send", torch.full((n,), float(value)), tag, f"send {tag}={value}")
    assert pending.done.is_set() and pending.error is None
    return pending


def recv(channel: Channel, tag: int, n: int = 4) -> Pending:
    return channel.post("recv", torch.zeros(n), tag, f"recv {tag}")


def value(pending: Pending) -> float:
    """The one value a received tensor holds in every element."""
    assert pending.error is None, pending.error
    assert bool((pending.tensor == pending.tensor[0]).all())
    return float(pending.tensor[0])
