"""PeerLink on zmq and tcp pairs: the deadlines, cancellation, ABORT, BYE and loss behave as on gloo pairs.

Two links in this process (Attention rank 0 and FFN rank 0 of 1A1F, global ranks 0 and 1) on a
real loopback pair (:func:`afd_mrv2.hooks.p2p.zmq_channel.loopback_pair` or
:func:`afd_mrv2.hooks.p2p.tcp_channel.loopback_pair`): no thread of ours reads, the waiting link's
own thread does, as in the roles.  Every test runs on both transports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from afd_mrv2.errors import PipelineAborted
from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.errors import PeerAborted, PeerLost, PeerTimeout
from afd_mrv2.hooks.p2p.link import PeerLink
from afd_mrv2.items import WorkItem
from afd_mrv2.topology import Topology
from afd_mrv2.work import INPUT, OUTPUT, BufferSlot, Work
from tests.hooks.p2p.channel_links import channel_links

TOPOLOGY = Topology(1, 1, 2)
WAIT = {"action": "receiving the combine", "option": "recv_timeout_s"}


@pytest.fixture(params=["zmq", "tcp"])
def kind(request: pytest.FixtureRequest) -> str:
    """The pair's transport."""
    return str(request.param)


@pytest.fixture
def links(kind: str) -> Iterator[tuple[PeerLink, PeerLink]]:
    """(the Attention rank's link, the FFN rank's link) on one ``kind`` pair named ``a0.1-f0.1``."""
    with channel_links(TOPOLOGY, kind) as links:
        yield links


def _header() -> torch.Tensor:
    return torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)


def test_data_moves_both_ways_through_the_links(links: tuple[PeerLink, PeerLink]) -> None:
    attention, ffn = links
    sent, got, back = torch.arange(6, dtype=torch.int64), _header()[:6], _header()[:6]
    receive = ffn.irecv(got, 0, wire.TAG_DISPATCH_HEADER, "dispatch header")
    attention.wait(
        [attention.isend(sent, 1, wire.TAG_DISPATCH_HEADER, "dispatch header")], timeout_s=5, work=None, **WAIT
    )
    ffn.wait([receive], timeout_s=5, work=None, **WAIT)
    combine = attention.irecv(back, 1, wire.TAG_COMBINE, "combine")
    ffn.wait([ffn.isend(got * 2, 0, wire.TAG_COMBINE, "combine")], timeout_s=5, work=None, **WAIT)
    attention.wait([combine], timeout_s=5, work=None, **WAIT)
    assert got.tolist() == list(range(6)) and back.tolist() == [2 * i for i in range(6)]
    assert 0 < combine.posted_at <= combine.done_at


def test_a_silent_peer_fails_the_wait_at_its_deadline_naming_it(links: tuple[PeerLink, PeerLink]) -> None:
    attention, _ = links
    pending = attention.irecv(_header(), 1, wire.TAG_COMBINE, "combine message")
    start = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        attention.wait([pending], timeout_s=0.3, work=None, **WAIT)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert info.value.peer == 1
    assert str(info.value).startswith("attention rank 0 (global rank 0): FFN rank 0 (global rank 1) is connected but")
    assert "sent no combine message within 0.3 s (recv_timeout_s) while receiving the combine" in str(info.value)


def test_a_cancelled_item_ends_its_wait_within_a_slice(links: tuple[PeerLink, PeerLink]) -> None:
    attention, _ = links
    cancel = threading.Event()
    work = Work(WorkItem(0, 0, 0), BufferSlot(INPUT, 0, None, None), BufferSlot(OUTPUT, 0, None, None), cancel)
    pending = attention.irecv(_header(), 1, wire.TAG_COMBINE, "combine message")
    threading.Timer(0.1, cancel.set).start()
    start = time.monotonic()
    with pytest.raises(PipelineAborted, match="pipeline stopped while"):
        attention.wait([pending], timeout_s=30, work=work, **WAIT)
    assert time.monotonic() - start < 1.0


def test_an_abort_is_raised_with_the_peers_reason(links: tuple[PeerLink, PeerLink]) -> None:
    attention, ffn = links
    pending = attention.irecv(_header(), 1, wire.TAG_COMBINE, "combine message")
    ffn.abort("FFN rank 0 stopped serving: a bad header", linger_s=0.0)
    with pytest.raises(PeerAborted) as info:
        attention.wait([pending], timeout_s=5, work=None, **WAIT)
    assert info.value.peer == 1
    assert str(info.value) == (
        "attention rank 0 (global rank 0): FFN rank 0 (global rank 1) aborted the run: "
        "FFN rank 0 (global rank 1): FFN rank 0 stopped serving: a bad header"
    )


def test_goodbye_on_both_sides_ends_without_an_error(links: tuple[PeerLink, PeerLink]) -> None:
    attention, ffn = links
    closing = threading.Thread(target=ffn.close, kwargs={"timeout_s": 5})
    closing.start()
    attention.close(timeout_s=5)
    closing.join(5)
    assert not closing.is_alive()


def test_a_closed_peer_is_a_loss_naming_the_pair_and_the_transport(links: tuple[PeerLink, PeerLink], kind: str) -> None:
    attention, ffn = links
    pending = attention.irecv(_header(), 1, wire.TAG_COMBINE, "combine message")
    ffn.release()  # its sockets close, as when its process dies
    with pytest.raises(PeerLost) as info:
        attention.wait([pending], timeout_s=5, work=None, **WAIT)
    assert info.value.peer == 1
    assert "lost FFN rank 0 (global rank 1): its connection closed" in str(info.value)
    assert str(info.value).endswith(f"[{kind}: {kind} pair a0.1-f0.1: connection closed]")
    with pytest.raises(PeerLost):  # and every later post fails at once
        attention.wait(
            [attention.isend(_header(), 1, wire.TAG_DISPATCH_HEADER, "dispatch header")], timeout_s=5, work=None, **WAIT
        )


def test_a_peer_declared_lost_fails_the_wait_at_once_and_every_post_until_a_new_pair(
    links: tuple[PeerLink, PeerLink],
) -> None:
    """A cut link sends no reset: whoever knows the peer is gone (serve, its node silent) says so with
    ``lose``; a wait on that peer ends within a slice, long before its deadline, naming the reason, and so does
    any post to it."""
    attention, _ = links
    pending = attention.irecv(_header(), 1, wire.TAG_COMBINE, "combine message")
    threading.Timer(0.2, attention.lose, args=(1, "serve declared it lost (node 1 is silent)")).start()
    start = time.monotonic()
    with pytest.raises(PeerLost) as info:
        attention.wait([pending], timeout_s=30, work=None, **WAIT)
    assert 0.2 <= time.monotonic() - start < 1.5 and info.value.peer == 1
    assert str(info.value) == (
        "attention rank 0 (global rank 0): lost FFN rank 0 (global rank 1): serve declared it lost (node 1 is silent)"
    )
    with pytest.raises(PeerLost, match="serve declared it lost"):
        attention.isend(_header(), 1, wire.TAG_DISPATCH_HEADER, "dispatch header")
    with pytest.raises(PeerLost, match="serve declared it lost"):
        attention.check_peers([1])
    attention.check_peers([])  # a wait that does not depend on it is unaffected
