"""ZmqChannel (RFC 0007, decisions 4-7): matching, kept messages, waiters, loss, the token.

Two channels of one process over tcp loopback, and a peer process for the losses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from afd_mrv2.hooks.p2p import zmq_channel  # pyzmq is a dependency: its absence fails, never skips
from afd_mrv2.hooks.p2p.channel import ChannelClosed, ChannelError
from afd_mrv2.hooks.p2p.link import Pending
from tests.hooks.p2p.channel_links import recv, send, value, wait

ZmqChannel = zmq_channel.ZmqChannel


@pytest.fixture
def pair() -> Iterator[tuple[ZmqChannel, ZmqChannel]]:
    a, f = zmq_channel.loopback_pair(name="a0.1-f0.1")
    yield a, f
    a.close()
    f.close()


def test_two_waiters_on_one_channel(pair: tuple[ZmqChannel, ZmqChannel]) -> None:
    """One reads, the other waits on its Pending and is woken when the reader completes it or leaves
    (not at the end of its 50 ms slice)."""
    a, f = pair
    took = []
    for _ in range(20):
        posted = [recv(f, 1), recv(f, 2)]
        results: list[float] = []

        def waiter(pending: Pending, results: list[float] = results) -> None:
            results.append(value(wait(f, pending)))

        waiters = [threading.Thread(target=waiter, args=(p,)) for p in posted]
        start = time.perf_counter()
        for thread in waiters:
            thread.start()
        send(a, 2, 2.0)
        send(a, 1, 1.0)
        for thread in waiters:
            thread.join(10)
        took.append(time.perf_counter() - start)
        assert sorted(results) == [1.0, 2.0]
    assert sorted(took)[len(took) // 2] < 0.025


def test_a_length_mismatch_fails_that_receive_only(pair: tuple[ZmqChannel, ZmqChannel]) -> None:
    a, f = pair
    short = recv(f, 1, n=2)
    send(a, 1, 1.0, n=4)
    assert isinstance(wait(f, short).error, ChannelError)
    assert "expected 8 bytes, the peer sent 16" in str(short.error)
    send(a, 1, 2.0, n=4)  # read past (kept), then posted with the wrong length
    assert value(wait(f, recv(f, 1, n=4))) == 2.0
    send(a, 3, 3.0, n=4)
    send(a, 1, 4.0, n=4)
    wait(f, recv(f, 1))
    kept_short = recv(f, 3, n=3)
    assert kept_short.done.is_set() and "expected 12 bytes, the peer sent 16" in str(kept_short.error)
    assert f.lost is None


def test_a_wrong_token_is_refused_in_one_line() -> None:
    binder, endpoints = zmq_channel.listen(peer=0, name="a0.1-f0.2")
    connector = zmq_channel.connect(endpoints, peer=1, name="a0.1-f0.2")
    stray = threading.Thread(
        target=zmq_channel._token_step,
        args=(
            connector,
            b"afd-zmq-token:" + b"0" * 32 + b"@" + connector.endpoint.encode(),
            time.monotonic() + 5,
            bool,
        ),
    )
    stray.start()
    with pytest.raises(ChannelError, match=r"^zmq pair a0.1-f0.2: the peer sent a wrong token") as info:
        zmq_channel.exchange_token(binder, endpoints.token, first=False, timeout_s=5)
    stray.join()
    assert "\n" not in str(info.value)
    with pytest.raises(ChannelError, match="no token from the peer"):
        zmq_channel.exchange_token(connector, endpoints.token, first=False, timeout_s=0.2)
    for channel in (binder, connector):
        channel.close()


# ---------------------------------------------------------------------- a peer process

PEER = """
import os, signal, sys, time, torch, zmq
from afd_mrv2.hooks.p2p import zmq_channel
channel, endpoints = zmq_channel.listen(peer=0, name="peer")
print(endpoints.to_json(), flush=True)
assert zmq_channel.exchange_token(channel, endpoints.token, first=False, timeout_s=10)
mode = sys.argv[1]
if mode != "idle":
    channel.post("send", torch.frombuffer(bytearray(b"ABORT: out of memory"), dtype=torch.uint8), 9, "abort")
if mode == "abort_exit":
    channel.close()
    zmq.Context.instance().term()  # the linger lets the notice out
    sys.exit(0)
if mode == "abort_kill":
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


@pytest.fixture
def peer(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], ZmqChannel]]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.Popen([sys.executable, "-c", PEER, request.param], stdout=subprocess.PIPE, text=True, cwd=root)
    assert proc.stdout is not None
    endpoints = zmq_channel.ZmqEndpoints.from_json(proc.stdout.readline())
    channel = zmq_channel.connect(endpoints, peer=1, name="a0.1-f0.3")
    assert zmq_channel.exchange_token(channel, endpoints.token, first=True, timeout_s=10)
    yield proc, channel
    channel.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.mark.parametrize("peer", ["idle"], indirect=True)
def test_a_killed_peer_fails_every_posted_receive_and_every_later_post(
    peer: tuple[subprocess.Popen[str], ZmqChannel],
) -> None:
    proc, channel = peer
    posted = [recv(channel, tag) for tag in (1, 2, 2, 3)]
    before = time.perf_counter()
    proc.send_signal(signal.SIGKILL)
    wait(channel, posted[0])
    for pending in posted:
        assert pending.done.is_set() and isinstance(pending.error, ChannelClosed)
        assert "connection closed" in str(pending.error)
        assert before < pending.done_at == channel.lost_at
    assert channel.lost is posted[0].error
    later = [recv(channel, 1), channel.post("send", torch.ones(4), 1, "send")]
    assert all(p.done.is_set() and p.error is channel.lost for p in later)


@pytest.mark.parametrize("peer", ["abort_exit", "abort_kill"], indirect=True)
def test_the_last_message_before_the_peer_left_is_read_before_the_loss(
    peer: tuple[subprocess.Popen[str], ZmqChannel],
) -> None:
    proc, channel = peer
    data = recv(channel, 1)
    proc.wait(10)
    time.sleep(0.2)  # the message and the disconnect are both ready when the waiter polls
    wait(channel, data)
    assert isinstance(data.error, ChannelClosed)
    notice = channel.post("recv", torch.zeros(20, dtype=torch.uint8), 9, "abort")
    assert notice.done.is_set() and notice.error is None  # kept, then handed over after the loss
    assert bytes(notice.tensor.tolist()) == b"ABORT: out of memory"
