"""TcpChannel (RFC 0007, amendment 2): matching, kept messages, waiters, large and partial messages, the send
deadline, loss, close, and the token handshake of a pair.

Two channels of one process over tcp loopback (:func:`tcp_channel.loopback_pair`), a raw socket that
speaks the wire format by hand (12-byte envelope ``<IQ``: tag, nbytes; then the bytes), and a peer process
for the losses.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from afd_mrv2 import envs
from afd_mrv2.hooks.p2p import tcp_channel
from afd_mrv2.hooks.p2p.channel import ChannelClosed, ChannelError, Endpoints, Pending
from tests.hooks.p2p.channel_links import recv, send, value, wait

TcpChannel = tcp_channel.TcpChannel
ENVELOPE = struct.Struct("<IQ")  # the wire format, written by hand here
HELLO, ACK = b"afd-tcp-token:", b"afd-tcp-ok:"
BIG = 32 << 20  # bytes: far past loopback's socket buffers


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def address(endpoints: Endpoints) -> tuple[str, int]:
    host, _, port = endpoints.endpoint.rpartition(":")
    return host, int(port)


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    got = b""
    while len(got) < nbytes:
        chunk = sock.recv(nbytes - len(got))
        if not chunk:
            break
        got += chunk
    return got


@pytest.fixture
def pair() -> Iterator[tuple[TcpChannel, TcpChannel]]:
    a, f = tcp_channel.loopback_pair(name="a0.1-f0.1")
    yield a, f
    a.close()
    f.close()


@pytest.fixture
def raw() -> Iterator[tuple[TcpChannel, socket.socket]]:
    """(a listening side's channel, the raw socket of its peer, past the handshake, written by hand)."""
    listener = tcp_channel.listen(name="a0.1-f0.4")
    sock = socket.create_connection(address(listener.endpoints), timeout=30)
    sock.sendall(HELLO + listener.endpoints.token.encode())
    channel = listener.accept(peer=1, timeout_s=30)
    listener.close()
    assert channel is not None
    assert recv_exact(sock, len(ACK) + 32) == ACK + listener.endpoints.token.encode()
    yield channel, sock
    channel.close()
    sock.close()


# ---------------------------------------------------------------------- matching and kept messages


def test_over_max_kept_unreceived_messages_of_a_tag_lose_the_channel() -> None:
    a, f = tcp_channel.loopback_pair(name="a0.1-f0.5", max_kept=2)
    try:
        for v in (1.0, 2.0, 3.0):
            send(a, 1, v)
        other = wait(f, recv(f, 2))  # its waiter reads the three past: one too many
        assert isinstance(other.error, ChannelError) and other.error is f.lost
        assert str(f.lost) == "tcp pair a0.1-f0.5: over 2 unreceived messages of tag 1"
    finally:
        a.close()
        f.close()


def test_a_length_mismatch_fails_that_receive_only(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, f = pair
    short = recv(f, 1, n=2)
    send(a, 1, 1.0, n=4)
    assert isinstance(wait(f, short).error, ChannelError)
    assert str(short.error) == "tcp pair a0.1-f0.1: recv 1 (tag 1) expected 8 bytes, the peer sent 16"
    send(a, 1, 2.0, n=4)  # the stream goes on: the next message of the tag is intact
    assert value(wait(f, recv(f, 1, n=4))) == 2.0
    send(a, 3, 3.0, n=4)
    send(a, 1, 4.0, n=4)
    wait(f, recv(f, 1))  # reads the tag-3 message past (kept), then posted with the wrong length
    kept_short = recv(f, 3, n=3)
    assert kept_short.done.is_set() and "expected 12 bytes, the peer sent 16" in str(kept_short.error)
    send(a, 3, 5.0)
    assert value(wait(f, recv(f, 3))) == 5.0
    assert f.lost is None


# ---------------------------------------------------------------------- waiters


def test_two_waiters_on_one_channel_each_get_their_message(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, f = pair
    for round_ in range(20):
        posted = [recv(f, 1), recv(f, 2)]
        results: list[float] = []

        def waiter(pending: Pending, results: list[float] = results) -> None:
            results.append(value(wait(f, pending)))

        waiters = [threading.Thread(target=waiter, args=(p,)) for p in posted]
        for thread in waiters:
            thread.start()
        first, second = (2, 1) if round_ % 2 else (1, 2)
        send(a, first, float(first))
        send(a, second, float(second))
        for thread in waiters:
            thread.join(30)
        assert sorted(results) == [1.0, 2.0]


def test_a_waiter_whose_receive_the_reader_completed_returns_without_waiting_out_the_reader(
    pair: tuple[TcpChannel, TcpChannel],
) -> None:
    """One waiter reads with a long slice for a message that does not come; the other's message arrives and
    the reader completes it: the other returns then, not when the reader's slice ends."""
    a, f = pair
    slow, quick = recv(f, 1), recv(f, 2)
    returned: dict[str, bool] = {}
    reader = threading.Thread(target=lambda: returned.update(slow=f.await_done(slow, 60.0)))
    reader.start()
    time.sleep(0.2)  # the first waiter holds the receive side (on a slow machine the test only proves less)
    other = threading.Thread(target=lambda: returned.update(quick=f.await_done(quick, 60.0)))
    other.start()
    time.sleep(0.2)  # the second waits for the first
    send(a, 2, 2.0)
    other.join(20)
    try:
        assert not other.is_alive(), "the completed receive's waiter waited out the reader's slice"
        assert returned == {"quick": True} and value(quick) == 2.0 and not slow.done.is_set()
    finally:
        send(a, 1, 1.0)
        reader.join(30)
        other.join(60)
    assert returned == {"quick": True, "slow": True} and value(slow) == 1.0


# ---------------------------------------------------------------------- large and partial messages


@pytest.mark.parametrize("posted_first", [True, False], ids=["posted", "kept"])
def test_both_sides_sending_large_messages_at_once_complete_intact(
    pair: tuple[TcpChannel, TcpChannel], posted_first: bool
) -> None:
    """Each side sends, then waits for the other's message.  A send waits for room and meanwhile reads the
    other's message, so neither blocks the other: no deadlock, whether the receive was posted before (read
    straight in) or after the send (kept, or resumed where the sender's reads left it)."""
    a, f = pair
    out = {a: random_bytes(BIG, 1), f: random_bytes(BIG, 2)}
    into = {a: torch.zeros(BIG, dtype=torch.uint8), f: torch.zeros(BIG, dtype=torch.uint8)}
    done: dict[TcpChannel, tuple[Pending, Pending]] = {}

    def side(channel: TcpChannel) -> None:
        receive = channel.post("recv", into[channel], 4, "big recv") if posted_first else None
        sent = channel.post("send", out[channel], 4, "big send")
        receive = receive or channel.post("recv", into[channel], 4, "big recv")
        done[channel] = (sent, wait(channel, receive, 100))

    threads = [threading.Thread(target=side, args=(channel,)) for channel in (a, f)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(110)
        assert not thread.is_alive(), "the two large sends deadlocked"
    assert [p.error for pair_ in done.values() for p in pair_] == [None] * 4
    assert torch.equal(into[f], out[a]) and torch.equal(into[a], out[f])
    assert a.lost is None and f.lost is None


def test_a_message_arriving_in_pieces_is_resumed_across_slices_and_waiters(
    raw: tuple[TcpChannel, socket.socket],
) -> None:
    """The envelope and the body come in pieces; each await_done slice ends with the message read in part,
    the next one (on another Pending, of another thread) resumes it."""
    channel, sock = raw
    body = bytes(random_bytes(100_000, 3).tolist())
    message = ENVELOPE.pack(5, len(body)) + body
    target, other = channel.post("recv", torch.zeros(len(body), dtype=torch.uint8), 5, "pieces"), recv(channel, 6)
    pieces = [message[:5], message[5 : 12 + 1000], message[12 + 1000 : 12 + 50_000]]  # half an envelope first
    for i, piece in enumerate(pieces):
        sock.sendall(piece)
        assert not channel.await_done((target, other)[i % 2], 0.05)  # reads the piece, ends its slice
        assert not target.done.is_set()
    sock.sendall(message[12 + 50_000 :])
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(wait(channel, target) is target))
    thread.start()
    thread.join(30)
    assert done == [True] and target.error is None and bytes(target.tensor.tolist()) == body
    sock.sendall(ENVELOPE.pack(6, 16) + struct.pack("<4f", 6.0, 6.0, 6.0, 6.0))
    assert value(wait(channel, other)) == 6.0 and channel.lost is None


def test_a_wait_spins_only_while_the_waits_for_its_tag_are_short(
    pair: tuple[TcpChannel, TcpChannel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait first reads without sleeping (up to SPIN_S), unless the waits for its tag typically took longer
    than SPIN_WHEN_S: then it sleeps in poll after one read and costs (almost) no CPU while nothing comes."""
    a, f = pair
    monkeypatch.setattr(tcp_channel, "SPIN_S", 0.005)  # long enough to read twice, however loaded the host
    monkeypatch.setattr(tcp_channel, "SPIN_WHEN_S", 0.001)  # a 0.2 s wait counts 10 ms: the average 1.25 ms
    reads, before_poll = [0], []
    read_ready, readable = f._read_ready, f._readable

    def counted(until: Pending | None) -> bool:
        reads[0] += 1
        return read_ready(until)

    class Poll:
        def poll(self, timeout_ms: int) -> list[tuple[int, int]]:
            before_poll.append(reads[0])
            return readable.poll(timeout_ms)

    monkeypatch.setattr(f, "_read_ready", counted)
    monkeypatch.setattr(f, "_readable", Poll())

    def idle_wait(tag: int) -> tuple[int, float]:
        """Reads before the first poll, and CPU seconds, of a 50 ms wait on ``tag`` for nothing."""
        reads[0], cpu = 0, time.thread_time()
        before_poll.clear()
        assert not f.await_done(recv(f, tag), 0.05)
        return before_poll[0], time.thread_time() - cpu

    for _ in range(5):  # quick waits: the message is there
        send(a, 1, 1.0)
        assert value(wait(f, recv(f, 1))) == 1.0
    assert idle_wait(1)[0] >= 2  # spun
    late = recv(f, 2)
    timer = threading.Timer(0.2, lambda: send(a, 2, 2.0))
    timer.start()
    assert value(wait(f, late)) == 2.0  # a long wait for tag 2
    timer.join()
    reads_first, cpu_s = idle_wait(2)
    assert reads_first == 1 and cpu_s < 0.004  # no spin: straight to poll
    assert idle_wait(3)[0] >= 2  # another tag still spins
    assert f.lost is None


def test_the_plan_of_a_wait_follows_the_recent_waits_for_its_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short waits spin at once; regular longer ones doze until WAKE_EARLY_S before the shortest recent one
    would end, then spin for WAKE_WINDOW_S; too little history, an idle peer, or a window of 0: no spin."""
    waits = tcp_channel._WaitTimes()
    assert waits.plan(1) == (0.0, tcp_channel.SPIN_S)  # nothing known: spin (an answer may be quick)
    for _ in range(20):
        waits.learn(1, 50e-6)
    assert waits.plan(1) == (0.0, tcp_channel.SPIN_S)
    for took in [5e-3] * (tcp_channel.RECENT_WAITS - 1):
        waits.learn(2, took)
    assert waits.plan(2) == (0.0, 0.0)  # not enough history yet
    waits.learn(2, 3e-3)
    doze, spin = waits.plan(2)
    assert doze == pytest.approx(3e-3 - tcp_channel.WAKE_EARLY_S) and spin == tcp_channel.WAKE_WINDOW_S
    for _ in range(tcp_channel.RECENT_WAITS):
        waits.learn(3, 0.2)  # an idle peer
    assert waits.plan(3) == (0.0, 0.0)
    short, off = tcp_channel._WaitTimes("short"), tcp_channel._WaitTimes("off")  # $AFD_MRV2_TCP_SPIN
    for times in (short, off):
        for took in [50e-6] * 20 + [3e-3] * tcp_channel.RECENT_WAITS:
            times.learn(1 if took < 1e-3 else 0, took)  # tag 1: the short waits, tag 0: the longer ones
    assert short.plan(1) == (0.0, tcp_channel.SPIN_S) and short.plan(0) == (0.0, 0.0)
    assert off.plan(1) == off.plan(0) == (0.0, 0.0)
    monkeypatch.setattr(tcp_channel, "WAKE_WINDOW_S", 0.0)
    assert waits.plan(2) == (0.0, 0.0) and waits.plan(1) == (0.0, tcp_channel.SPIN_S)


def test_the_spin_setting_is_read_from_the_environment_and_a_bad_value_is_named() -> None:
    assert envs.tcp_spin({}) == "on" and envs.tcp_spin({"AFD_MRV2_TCP_SPIN": " Short "}) == "short"
    with pytest.raises(ValueError, match=r"^AFD_MRV2_TCP_SPIN must be one of on, short, off, got 'fast'$"):
        envs.tcp_spin({"AFD_MRV2_TCP_SPIN": "fast"})


def test_a_regular_longer_wait_dozes_then_reads_without_sleeping_before_its_message_is_due(
    pair: tuple[TcpChannel, TcpChannel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After waits of about 20 ms, the next wait sleeps (in select, no read) for most of its time and is
    reading without sleeping before the message comes: no sleep in poll at all when it comes within the
    window, and the CPU it used is a fraction of the wait."""
    monkeypatch.setattr(tcp_channel, "WAKE_EARLY_S", 0.004)  # wide enough for a timer on a loaded host
    monkeypatch.setattr(tcp_channel, "WAKE_WINDOW_S", 0.008)
    a, f = pair
    polls, readable = [0], f._readable

    class Poll:
        def poll(self, timeout_ms: int) -> list[tuple[int, int]]:
            polls[0] += 1
            return readable.poll(timeout_ms)

    monkeypatch.setattr(f, "_readable", Poll())

    def late_wait(delay_s: float) -> tuple[float, float, int]:
        """Wall and CPU seconds of a wait for a message sent ``delay_s`` after it began, and its polls."""
        pending, polls[0] = recv(f, 7), 0
        timer = threading.Timer(delay_s, lambda: send(a, 7, 7.0))
        start, cpu = time.monotonic(), time.thread_time()
        timer.start()
        assert value(wait(f, pending)) == 7.0
        timer.join()
        return time.monotonic() - start, time.thread_time() - cpu, polls[0]

    for _ in range(tcp_channel.RECENT_WAITS):
        late_wait(0.02)
    took = [late_wait(0.02) for _ in range(5)]
    # a late timer (a loaded host) misses the window: then the wait sleeps in poll as before, so ask for most
    assert sum(1 for _, _, polls_made in took if polls_made == 0) >= 3, took
    assert all(cpu < 0.5 * wall for wall, cpu, _ in took), took  # dozed: not a spin of the whole wait
    assert f.lost is None


def test_a_message_cut_by_the_loss_fails_its_receive(raw: tuple[TcpChannel, socket.socket]) -> None:
    channel, sock = raw
    target = recv(channel, 5, n=1000)
    sock.sendall(ENVELOPE.pack(5, 4000) + bytes(2000))
    assert not channel.await_done(target, 0.05)
    sock.sendall(ENVELOPE.pack(6, 4000)[:3])  # nor is the half envelope of no receive kept
    sock.close()
    wait(channel, target)
    assert isinstance(target.error, ChannelClosed) and target.error is channel.lost
    assert str(channel.lost) == "tcp pair a0.1-f0.4: connection closed"
    assert recv(channel, 6).error is channel.lost


# ---------------------------------------------------------------------- the send deadline and close


def test_a_send_to_a_peer_that_never_reads_fails_after_send_timeout_s_and_loses_the_channel() -> None:
    a, f = tcp_channel.loopback_pair(name="a0.1-f0.6", send_timeout_s=0.5)
    try:
        posted_at = time.monotonic()
        stuck = a.post("send", torch.zeros(2 * BIG, dtype=torch.uint8), 4, "the dispatch hidden states")
        assert time.monotonic() - posted_at >= 0.5
        assert stuck.done.is_set() and stuck.error is a.lost and type(stuck.error) is ChannelError
        assert str(a.lost) == "tcp pair a0.1-f0.6: the peer did not accept the dispatch hidden states within 0.5 s"
        later = [recv(a, 1), a.post("send", torch.ones(4), 1, "send")]
        assert all(p.done.is_set() and p.error is a.lost for p in later)
        cut = f.post("recv", torch.zeros(2 * BIG, dtype=torch.uint8), 4, "the dispatch hidden states")
        a.close()  # the stream was cut mid-message: the peer fails that receive, never fills it in part
        wait(f, cut, 60)
        assert isinstance(cut.error, ChannelClosed)
    finally:
        a.close()
        f.close()


def test_close_is_idempotent_fails_what_is_posted_and_the_peer_reads_what_came_before(
    pair: tuple[TcpChannel, TcpChannel],
) -> None:
    a, f = pair
    send(f, 3, 3.0)  # unread by a when it closes: the close is still a FIN, never a reset
    posted = recv(a, 1)
    waiting = recv(f, 1)
    send(a, 9, 9.0)
    a.close()
    a.close()
    assert isinstance(posted.error, ChannelClosed) and posted.error is a.lost
    assert str(a.lost) == "tcp pair a0.1-f0.1: connection closed by this side"
    assert recv(a, 3).error is a.lost and a.post("send", torch.ones(4), 1, "send").error is a.lost
    wait(f, waiting)
    assert isinstance(waiting.error, ChannelClosed) and str(waiting.error) == "tcp pair a0.1-f0.1: connection closed"
    assert value(recv(f, 9)) == 9.0  # read before the loss, handed over after it
    f.close()
    f.close()


# ---------------------------------------------------------------------- a peer process

PEER = """
import os, sys, time, torch
from afd_mrv2 import envs
from afd_mrv2.hooks.p2p import tcp_channel
listener = tcp_channel.listen(name="peer")
print(listener.endpoints.to_json(), flush=True)
channel = listener.accept(peer=0, timeout_s=30)
listener.close()
mode = sys.argv[1]
if mode != "idle":
    channel.post("send", torch.frombuffer(bytearray(b"ABORT: out of memory"), dtype=torch.uint8), 9, "abort")
if mode == "abort_exit":
    channel.close()
    sys.exit(0)
print("sent", flush=True)
time.sleep(60)
"""


@pytest.fixture
def peer(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], TcpChannel]]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.Popen([sys.executable, "-c", PEER, request.param], stdout=subprocess.PIPE, text=True, cwd=root)
    assert proc.stdout is not None
    endpoints = Endpoints.from_json(proc.stdout.readline())
    channel = tcp_channel.connect(endpoints, peer=1, name="a0.1-f0.3", timeout_s=30)
    assert channel is not None
    yield proc, channel
    channel.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.mark.parametrize("peer", ["idle"], indirect=True)
def test_a_killed_peer_fails_every_posted_receive_and_every_later_post(
    peer: tuple[subprocess.Popen[str], TcpChannel],
) -> None:
    proc, channel = peer
    assert proc.stdout is not None and proc.stdout.readline() == "sent\n"
    posted = [recv(channel, tag) for tag in (1, 2, 2, 3)]
    before = time.perf_counter()
    proc.kill()  # SIGKILL
    wait(channel, posted[0])
    for pending in posted:
        assert pending.done.is_set() and isinstance(pending.error, ChannelClosed)
        assert str(pending.error).startswith("tcp pair a0.1-f0.3: connection closed")
        assert before < pending.done_at == channel.lost_at
    assert channel.lost is posted[0].error
    later = [recv(channel, 1), channel.post("send", torch.ones(4), 1, "send")]
    assert all(p.done.is_set() and p.error is channel.lost for p in later)


@pytest.mark.parametrize(
    ("peer", "kill", "unread"),
    [("abort_exit", False, False), ("abort", True, False), ("abort", True, True)],
    indirect=["peer"],
    ids=["exited", "killed", "killed-with-unread-bytes"],
)
def test_the_last_message_before_the_peer_left_is_read_before_the_loss(
    peer: tuple[subprocess.Popen[str], TcpChannel], kill: bool, unread: bool
) -> None:
    """The peer exits after closing its channel (a FIN), or is killed (a FIN; a reset when bytes this side
    sent lie unread there): its ABORT, sent before, is read first either way."""
    proc, channel = peer
    data = recv(channel, 1)
    if kill:
        assert proc.stdout is not None and proc.stdout.readline() == "sent\n"
        if unread:
            send(channel, 2, 2.0)
        proc.kill()
    proc.wait(30)
    time.sleep(0.2)  # the message and the end of the stream are both there when the waiter reads
    wait(channel, data)
    assert isinstance(data.error, ChannelClosed) and data.error is channel.lost
    assert ("reset" in str(data.error).lower()) is unread
    notice = channel.post("recv", torch.zeros(20, dtype=torch.uint8), 9, "abort")
    assert notice.done.is_set() and notice.error is None  # kept, then handed over after the loss
    assert bytes(notice.tensor.tolist()) == b"ABORT: out of memory"


# ---------------------------------------------------------------------- the handshake


def test_the_listener_refuses_a_wrong_token_and_a_silent_connection_logs_each_and_accepts_the_peer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tcp_channel, "_HELLO_TIMEOUT_S", 0.3)
    caplog.set_level(logging.WARNING, logger=tcp_channel.__name__)
    listener = tcp_channel.listen(name="a0.1-f0.7")
    wrong = socket.create_connection(address(listener.endpoints), timeout=30)
    wrong.sendall(HELLO + b"0" * 32)
    silent = socket.create_connection(address(listener.endpoints), timeout=30)
    accepted: list[TcpChannel | None] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept(peer=0, timeout_s=60)))
    thread.start()
    try:
        assert recv_exact(wrong, 1) == b""  # refused: closed without an answer
        assert recv_exact(silent, 1) == b""
        connector = tcp_channel.connect(listener.endpoints, peer=1, name="a0.1-f0.7", timeout_s=30)
        thread.join(30)
        assert connector is not None and len(accepted) == 1 and accepted[0] is not None
        assert listener.refused == 2
        refusals = [r.getMessage() for r in caplog.records if r.name == tcp_channel.__name__]
        assert refusals[0] == "tcp pair a0.1-f0.7: refused a connection from 127.0.0.1: a wrong token"
        assert refusals[1].startswith("tcp pair a0.1-f0.7: refused a connection from 127.0.0.1: no token (")
        assert len(refusals) == 2
        assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == tcp_channel.__name__)
        back = recv(connector, 1)
        send(accepted[0], 1, 7.0)
        assert value(wait(connector, back)) == 7.0
        connector.close()
        accepted[0].close()
    finally:
        for sock in (wrong, silent):
            sock.close()
        listener.close()


def test_a_connection_that_dribbles_its_token_is_refused_at_the_hello_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hello deadline bounds the whole token, not each piece: a byte every 0.1 s does not hold the
    listener past it (the token is 46 bytes: 4.6 s at that pace)."""
    monkeypatch.setattr(tcp_channel, "_HELLO_TIMEOUT_S", 0.5)
    listener = tcp_channel.listen(name="a0.1-f0.9")
    slow = socket.create_connection(address(listener.endpoints), timeout=30)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: listener.accept(peer=0, timeout_s=60, give_up=stop.is_set), daemon=True)
    thread.start()
    token = HELLO + listener.endpoints.token.encode()
    start = time.monotonic()
    try:
        for byte in token:
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                break  # refused and closed
            if listener.refused:
                break
            time.sleep(0.1)
        assert listener.refused == 1
        assert time.monotonic() - start < 3.0  # well before the whole token could have arrived
    finally:
        stop.set()
        thread.join(10)
        slow.close()
        listener.close()


def test_connect_to_a_listener_that_refuses_this_sides_token_raises_one_line() -> None:
    listener = tcp_channel.listen(name="a0.1-f0.8")
    stop = threading.Event()
    accepted: list[TcpChannel | None] = []
    thread = threading.Thread(
        target=lambda: accepted.append(listener.accept(peer=0, timeout_s=60, give_up=stop.is_set))
    )
    thread.start()
    try:
        wrong = Endpoints(listener.endpoints.endpoint, "f" * 32)
        with pytest.raises(ChannelError, match=r"^tcp pair a0.1-f0.8: the peer refused this side's token") as info:
            tcp_channel.connect(wrong, peer=1, name="a0.1-f0.8", timeout_s=30)
        assert "\n" not in str(info.value)
    finally:
        stop.set()
        thread.join(30)
        listener.close()
    assert accepted == [None] and listener.refused == 1  # and give_up() ended the listener's wait


def test_connect_to_a_listener_that_closes_before_accepting_raises_one_line_naming_the_pair() -> None:
    """The listener closes (its side gave up, or its process ended) with this side's connection queued and
    unanswered: the connection is reset, a ChannelError naming the pair, like any failed handshake."""
    listener = tcp_channel.listen(name="a0.1-f0.9")

    def close_the_listener() -> bool:  # connect asks once connected, its token sent
        listener.close()
        return False

    with pytest.raises(ChannelError, match=r"^tcp pair a0.1-f0.9: ") as info:
        tcp_channel.connect(listener.endpoints, peer=1, name="a0.1-f0.9", timeout_s=30, give_up=close_the_listener)
    assert "\n" not in str(info.value) and "reset" in str(info.value).lower()
    with pytest.raises(ChannelError, match=r"^tcp pair a0.1-f0.9: cannot connect to 127.0.0.1:\d+: "):
        tcp_channel.connect(listener.endpoints, peer=1, name="a0.1-f0.9", timeout_s=30)  # nobody listens there now


def test_connect_gives_up_or_times_out_when_the_listener_does_not_answer() -> None:
    listener = tcp_channel.listen(name="a0.1-f0.10")  # listening, never accepting: the token is not answered
    try:
        calls = iter(range(1000))
        assert tcp_channel.connect(
            listener.endpoints, peer=1, name="a0.1-f0.10", timeout_s=60, give_up=lambda: next(calls) >= 3
        ) is None  # fmt: skip
        with pytest.raises(ChannelError, match=r"^tcp pair a0.1-f0.10: the peer did not answer this side's token"):
            tcp_channel.connect(listener.endpoints, peer=1, name="a0.1-f0.10", timeout_s=0.3)
    finally:
        listener.close()


def test_accept_gives_up_or_raises_after_timeout_s_naming_how_many_were_refused() -> None:
    listener = tcp_channel.listen(name="a0.1-f0.11")
    try:
        stop = threading.Event()
        threading.Timer(0.2, stop.set).start()
        assert listener.accept(peer=0, timeout_s=60, give_up=stop.is_set) is None
        with pytest.raises(ChannelError) as info:
            listener.accept(peer=0, timeout_s=0.3)
        assert str(info.value) == "tcp pair a0.1-f0.11: no peer with the pair's token within 0.3 s"
        wrong = socket.create_connection(address(listener.endpoints), timeout=30)
        wrong.sendall(HELLO + b"0" * 32)
        with pytest.raises(ChannelError) as info:
            listener.accept(peer=0, timeout_s=1.0)
        wrong.close()
        assert str(info.value) == (
            "tcp pair a0.1-f0.11: no peer with the pair's token within 1 s (1 refused: no or a wrong token)"
        )
    finally:
        listener.close()
