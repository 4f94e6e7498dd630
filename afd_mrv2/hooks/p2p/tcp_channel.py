"""TcpChannel: a :class:`~afd_mrv2.hooks.p2p.channel.Channel` on one TCP connection per pair, moved by
the hooks' own threads: no I/O thread, no watcher, no copy on the way out (RFC 0007, amendment 2).

A message is a 12-byte envelope (tag u32, nbytes u64) and the tensor's bytes.  The posting thread writes it
with one ``sendmsg``; the thread that waits in ``await_done`` reads straight into the posted receive.  See
:class:`TcpChannel` for waiting, full buffers and losses, and docs/internals/p2p-transport.md.

:func:`listen` / :func:`connect` build a pair: the listening side accepts only a connection that presents
the pair's token; any other is refused, logged, and the listener keeps waiting.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from afd_mrv2 import envs
from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.channel import ChannelClosed, ChannelError, Endpoints, Pending
from afd_mrv2.hooks.p2p.reading import ReaderChannel, finish

log = logging.getLogger(__name__)

_ENVELOPE = struct.Struct("<IQ")  # tag, nbytes
_HELLO = b"afd-tcp-token:"
_ACK = b"afd-tcp-ok:"
_TOKEN_BYTES = 32  # secrets.token_hex(16)
_HELLO_TIMEOUT_S = 5.0  # how long an accepted connection may take to present its token
_POLL_MS = 50  # the longest a blocked sender or a handshake step sleeps before looking again
#: how long a wait may look at the socket without sleeping before it sleeps in ``poll`` (see ``_read_until``)
SPIN_S = 100e-6
#: a wait spins only while the waits for its tag typically (a moving average) end within this
SPIN_WHEN_S = 4 * SPIN_S
_TYPICAL_CAP_S = 0.01  # one long wait (an idle peer) counts as this much in the average
#: a longer wait sleeps until this long before the shortest of the last :data:`RECENT_WAITS` waits for its tag
#: would end, then reads without sleeping (yielding the core to any other runnable thread) for up to
#: :data:`WAKE_WINDOW_S` before it sleeps in ``poll`` again: the wake-up lands before the message does
WAKE_EARLY_S = 150e-6
WAKE_WINDOW_S = 400e-6  # 0: a longer wait never wakes early
RECENT_WAITS = 8
_WAKE_LONGEST_S = 0.1  # waits this long or longer (an idle peer) never wake early
_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR
_FD_SETSIZE = 1024  # select's limit on a descriptor's number


class _Incoming:
    """The message being read: its envelope, then its body into ``target`` (a posted receive's bytes,
    a kept copy, or a discard buffer when the sizes disagree)."""

    __slots__ = ("body", "envelope", "got", "kept", "nbytes", "pending", "tag", "target")

    def __init__(self) -> None:
        self.envelope = memoryview(bytearray(_ENVELOPE.size))
        self.got = 0  # bytes of the envelope, then of the body
        self.body = False  # the envelope is complete: reading the body
        self.tag = self.nbytes = 0
        self.target: memoryview | None = None
        self.pending: Pending | None = None
        self.kept: bytearray | None = None

    def reset(self) -> None:
        self.got, self.body, self.target, self.pending, self.kept = 0, False, None, None, None


class _WaitTimes:
    """Per tag, how long the reader's waits took, and how the next wait should begin (:meth:`plan`).

    Short waits (a moving average within :data:`SPIN_WHEN_S`: a peer answering within microseconds) spin at
    once.  Longer ones (a peer computing for ms) doze until :data:`WAKE_EARLY_S` before the shortest of the last
    :data:`RECENT_WAITS` would have ended, then spin for up to :data:`WAKE_WINDOW_S`.  A rank whose waits are
    long (:data:`_WAKE_LONGEST_S`: an idle one) never spins.  ``spin`` (``$AFD_MRV2_TCP_SPIN``): ``"short"``
    spins only at once, ``"off"`` never.
    """

    __slots__ = ("_average", "_recent", "_spin")

    def __init__(self, spin: str = "on") -> None:
        self._spin = spin
        self._average: dict[int, float] = {}
        self._recent: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=RECENT_WAITS)
        )

    def learn(self, tag: int, took: float) -> None:
        average = self._average.get(tag, 0.0)
        self._average[tag] = average + (min(took, _TYPICAL_CAP_S) - average) / 8
        self._recent[tag].append(took)

    def plan(self, tag: int) -> tuple[float, float]:
        """(doze, spin) in seconds for a wait for ``tag`` beginning now; a spin of 0: sleep in ``poll`` at once."""
        if self._spin == "off":
            return 0.0, 0.0
        if self._average.get(tag, 0.0) <= SPIN_WHEN_S:
            return 0.0, SPIN_S
        recent = self._recent[tag]
        soonest = min(recent)
        if self._spin == "short" or not WAKE_WINDOW_S or len(recent) < RECENT_WAITS or soonest >= _WAKE_LONGEST_S:
            return 0.0, 0.0
        return max(0.0, soonest - WAKE_EARLY_S), WAKE_WINDOW_S


class TcpChannel(ReaderChannel):
    """The transfers with one peer (global rank ``peer``) of the pair ``name`` over ``sock`` (connected).

    A send Pending is done once the kernel took every byte.  When the socket buffer is full the sender waits
    for room (at most ``send_timeout_s``; past it the channel is lost, its stream being cut mid-message) and
    meanwhile reads what the peer sent, so two sides sending at once never deadlock.  A side that neither
    sends nor waits reads nothing: a peer's large send then waits until this side waits again (the roles
    always wait on something while their peer sends: the FFN for the next dispatch, the Attention side for
    the combine).

    One waiter at a time reads what has arrived straight into the posted receive of its tag (receives of a
    tag match sends in posting order) and stops at a message boundary once its own Pending is done; a
    message for a tag with no posted receive is kept (a copy, at most ``max_kept`` per tag) and copied in
    when one is posted.  A message read in part is resumed by the next waiter, so no waiter outstays its
    slice.  A wait may read without sleeping for a while before it sleeps in ``poll``: at once while the waits
    for its tag are short, or just before its message is due after longer ones (:class:`_WaitTimes`).  End of
    stream or a reset: what was received before is read first (a peer's last message, its ABORT, is never
    lost), then every posted and later Pending fails with
    :class:`~afd_mrv2.hooks.p2p.channel.ChannelClosed`.
    """

    transport = "tcp"

    def __init__(
        self, sock: socket.socket, *, peer: int, name: str, send_timeout_s: float = 30.0, max_kept: int = 64
    ) -> None:
        super().__init__(peer=peer, name=name, send_timeout_s=send_timeout_s, max_kept=max_kept, flags=True)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self.address = sock.getsockname()[0]  # this side's address of the connection
        self.peer_address = sock.getpeername()[0]
        self._readable = select.poll()
        self._readable.register(sock, _READABLE)
        self._writable = select.poll()
        self._writable.register(sock, select.POLLOUT | select.POLLERR | select.POLLHUP)
        self._incoming = _Incoming()  # the reader's only
        # the reader's only: the Pending whose wait began last, when it began, and per tag how long waits took
        self._waiting: Pending | None = None
        self._waiting_since = 0.0
        self._waits = _WaitTimes(envs.tcp_spin())

    # ------------------------------------------------------------------ sending

    def _post_send(self, pending: Pending, tag: int, view: memoryview) -> None:
        deadline = time.monotonic() + self._send_timeout_s
        buffers: list[Any] = [_ENVELOPE.pack(tag, pending.nbytes), view]
        with self._send_lock:
            while self.lost is None:
                try:
                    buffers = _advance(buffers, self._sock.sendmsg(buffers))
                except BlockingIOError:
                    pass
                except OSError as exc:
                    self._lose(ChannelClosed(f"{self._pair}: connection closed ({exc.strerror or exc})"))
                    break
                if not buffers:
                    finish(pending, None)
                    return
                if time.monotonic() >= deadline:  # the stream is cut mid-message: the channel is done
                    text = f"the peer did not accept {pending.what} within {self._send_timeout_s:g} s"
                    self._lose(ChannelError(f"{self._pair}: {text}"))
                    break
                self._await_room()
        finish(pending, self.lost)

    def _await_room(self) -> None:
        """Wait up to a poll interval for room to send, reading what the peer sent (if no one else is)."""
        events = self._writable.poll(_POLL_MS)
        if any(event & select.POLLOUT for _, event in events):
            return
        if self._take_reader():
            try:
                self._read_ready(None)
            finally:
                self._release_reader()

    # ------------------------------------------------------------------ reading

    def _read_until(self, pending: Pending, deadline: float) -> None:
        """Read until ``pending`` is done or ``deadline``; between reads, sleep in ``poll``.  The first slice of
        a wait may read without sleeping for a while first (a wake-up from ``poll`` costs tens of us, more on an
        idle core of a VM): at once while the waits for its tag are short (:data:`SPIN_S`), or just before the
        message is due after a longer one (:data:`WAKE_EARLY_S`); see :class:`_WaitTimes`."""
        now = time.monotonic()
        if self._waiting is not pending and deadline - now > SPIN_S:  # the first slice of its wait
            self._waiting, self._waiting_since = pending, now
            doze_s, spin_s = self._waits.plan(pending.tag)
            if spin_s and doze_s + spin_s < deadline - now:
                if doze_s:
                    self._doze(doze_s)
                if self._spin(pending, time.monotonic() + spin_s, yielding=doze_s > 0):
                    self._learn(pending.tag)
                    return
        while not self._read_ready(pending):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._readable.poll(max(1, round(left * 1000)))
        if self._waiting is pending:
            self._learn(pending.tag)

    def _spin(self, pending: Pending, until: float, *, yielding: bool) -> bool:
        """Read without sleeping until ``pending`` is done (True) or ``until`` (False)."""
        while not self._read_ready(pending):
            if time.monotonic() >= until:
                return False
            if yielding:  # an early wake-up must not take the core from a thread with work (the model's)
                os.sched_yield()
        return True

    def _doze(self, seconds: float) -> None:
        """Sleep up to ``seconds`` (to the microsecond: ``select``), or until something arrives."""
        fd = self._sock.fileno()
        if fd < _FD_SETSIZE:
            select.select([fd], [], [], seconds)
        else:  # select cannot watch it: poll, to the millisecond below
            self._readable.poll(int(seconds * 1000))

    def _learn(self, tag: int) -> None:
        """The wait that began at ``_waiting_since`` for a message of ``tag`` ended now."""
        self._waits.learn(tag, time.monotonic() - self._waiting_since)

    def _read_ready(self, until: Pending | None) -> bool:
        """Read what has arrived, at most up to the message boundary after ``until`` is done; True once it is
        (or, with no ``until``, once nothing more is there).  The reader only."""
        incoming = self._incoming
        while self.lost is None:
            if until is not None and until.done.is_set() and incoming.got == 0 and not incoming.body:
                return True
            if incoming.body:
                assert incoming.target is not None  # set with the body
                view = incoming.target[incoming.got :]
            else:
                view = incoming.envelope[incoming.got :]
            try:
                n = self._sock.recv_into(view)
            except BlockingIOError:
                return until is None or until.done.is_set()
            except OSError as exc:
                self._lose(ChannelClosed(f"{self._pair}: connection closed ({exc.strerror or exc})"))
                break
            if n == 0:
                self._lose(ChannelClosed(f"{self._pair}: connection closed"))
                break
            incoming.got += n
            if not incoming.body and incoming.got == _ENVELOPE.size:
                self._start_body(*_ENVELOPE.unpack(incoming.envelope))
            if incoming.body and incoming.got == incoming.nbytes:
                self._end_body()
                self._wake_waiters()
        return True

    def _start_body(self, tag: int, nbytes: int) -> None:
        incoming = self._incoming
        incoming.tag, incoming.nbytes, incoming.got, incoming.body = tag, nbytes, 0, True
        pending = incoming.pending = self._take_posted(tag)
        if pending is not None and pending.nbytes == nbytes:
            incoming.target = wire.host_bytes(pending.tensor)
            return
        incoming.kept = bytearray(nbytes)
        incoming.target = memoryview(incoming.kept)

    def _end_body(self) -> None:
        incoming = self._incoming
        pending, tag, kept = incoming.pending, incoming.tag, incoming.kept
        incoming.reset()
        if pending is not None:  # read into its tensor, or (a size mismatch) into a copy that fails it
            finish(pending, None if kept is None else self._mismatch(pending, tag, len(kept)))
            return
        assert kept is not None
        self._keep(tag, kept)

    def _lose(self, error: ChannelError, *also: Pending | None) -> None:
        super()._lose(error, self._incoming.pending, *also)  # the receive being read in part fails too

    def close(self) -> None:
        """Close the connection (once; a second call does nothing); Pendings still posted fail.  What the peer
        sent and nobody read is discarded first, so that the close is a FIN after everything this side sent
        (its ABORT included), never a reset that could cost the peer those bytes."""
        if not self._close_reading():
            return
        self._lose(ChannelClosed(f"{self._pair}: connection closed by this side"))
        _drain(self._sock)
        with contextlib.suppress(OSError):  # the peer reset it already
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _advance(buffers: list[Any], sent: int) -> list[Any]:
    """``buffers`` less their first ``sent`` bytes."""
    while buffers and sent >= len(buffers[0]):
        sent -= len(buffers[0])
        buffers = buffers[1:]
    if sent:
        buffers = [memoryview(buffers[0])[sent:], *buffers[1:]]
    return buffers


def _drain(sock: socket.socket) -> None:
    scratch = bytearray(1 << 16)
    try:
        while sock.recv_into(scratch):
            pass
    except OSError:
        pass  # nothing more now (BlockingIOError), or the connection is gone


# ---------------------------------------------------------------------- building a pair


def _address(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class TcpListener:
    """The listening side (the FFN's) of one pair: a socket on an ephemeral port of ``bind`` and a token (a
    fresh one unless given), as :attr:`endpoints`; :meth:`accept` takes the one connection that presents it."""

    def __init__(self, *, name: str, bind: str = "127.0.0.1", token: str | None = None) -> None:
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.name = name
        self._sock = socket.create_server((bind, 0), family=family, backlog=8)
        self._sock.setblocking(False)
        host, port = self._sock.getsockname()[:2]
        self.endpoints = Endpoints(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}",
                                   token or secrets.token_hex(_TOKEN_BYTES // 2))  # fmt: skip
        self.refused = 0

    def accept(
        self, *, peer: int, timeout_s: float, give_up: Callable[[], bool] = lambda: False, **options: Any
    ) -> TcpChannel | None:
        """The pair's channel once a connection presented the token (and was answered); None when
        ``give_up()`` turned true first; :class:`ChannelError` after ``timeout_s`` without one.  A connection
        with another token, or none within a few seconds, is refused and logged; the wait goes on."""
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        while True:
            if give_up():
                return None
            if time.monotonic() >= deadline:
                refused = f" ({self.refused} refused: no or a wrong token)" if self.refused else ""
                raise ChannelError(
                    f"tcp pair {self.name}: no peer with the pair's token within {timeout_s:g} s{refused}"
                )
            if not poller.poll(_POLL_MS):
                continue
            try:
                conn, address = self._sock.accept()
            except BlockingIOError:
                continue
            channel = self._admit(conn, address, peer, options)
            if channel is not None:
                return channel

    def _admit(self, conn: socket.socket, address: Any, peer: int, options: dict[str, Any]) -> TcpChannel | None:
        expected = _HELLO + self.endpoints.token.encode()
        try:
            got = _recv_exact(conn, len(expected), time.monotonic() + _HELLO_TIMEOUT_S)
            if secrets.compare_digest(got, expected):
                conn.sendall(_ACK + self.endpoints.token.encode())
                return TcpChannel(conn, peer=peer, name=self.name, **options)
            reason = "a wrong token"
        except OSError as exc:
            reason = f"no token ({exc.strerror or exc})"
        self.refused += 1
        log.warning("tcp pair %s: refused a connection from %s: %s", self.name, address[0], reason)
        conn.close()
        return None

    def close(self) -> None:
        self._sock.close()


def listen(*, name: str, bind: str = "127.0.0.1", token: str | None = None) -> TcpListener:
    """The listening side of pair ``name`` on ``bind``, expecting ``token`` (a fresh one by default); publish
    its :attr:`TcpListener.endpoints` (or, where the token is derived from a secret, its endpoint only)."""
    return TcpListener(name=name, bind=bind, token=token)


def connect(
    endpoints: Endpoints,
    *,
    peer: int,
    name: str,
    timeout_s: float,
    give_up: Callable[[], bool] = lambda: False,
    bind: str | None = None,
    **options: Any,
) -> TcpChannel | None:
    """The connecting side (the Attention's): connect to ``endpoints`` (from ``bind`` when given), present the
    token, wait for the answer; None when ``give_up()`` turned true first; :class:`ChannelError` (one line
    naming the pair) when the peer refuses or does not answer in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    source = (bind, 0) if bind else None
    try:
        sock = socket.create_connection(_address(endpoints.endpoint), timeout=timeout_s, source_address=source)
    except OSError as exc:
        raise ChannelError(f"tcp pair {name}: cannot connect to {endpoints.endpoint}: {exc.strerror or exc}") from exc
    try:
        sock.sendall(_HELLO + endpoints.token.encode())
        expected = _ACK + endpoints.token.encode()
        while not select.select([sock], [], [], _POLL_MS / 1000)[0]:
            if give_up():
                sock.close()
                return None
            if time.monotonic() >= deadline:
                raise ChannelError(f"tcp pair {name}: the peer did not answer this side's token in time")
        got = _recv_exact(sock, len(expected), max(deadline, time.monotonic() + 0.1))
        if not secrets.compare_digest(got, expected):
            raise ChannelError(f"tcp pair {name}: the peer refused this side's token (not this pair's peer)")
        return TcpChannel(sock, peer=peer, name=name, **options)
    except OSError as exc:  # reset (the listener closed with this connection queued), timed out mid-answer
        sock.close()
        raise ChannelError(f"tcp pair {name}: the token exchange failed: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """``nbytes`` from ``sock`` by ``deadline`` (``time.monotonic()``; the whole read, not each piece, so a
    peer that dribbles bytes cannot hold it longer); fewer when it closes first, ``TimeoutError`` when late."""
    got = bytearray()
    while len(got) < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)
        chunk = sock.recv(nbytes - len(got))
        if not chunk:
            break
        got += chunk
    return bytes(got)


def loopback_pair(*, name: str = "a0-f0", timeout_s: float = 10.0, **options: Any) -> tuple[TcpChannel, TcpChannel]:
    """A joined pair on 127.0.0.1 in this process, for tests and benches: (connecting side, listening side)."""
    listener = listen(name=name)
    try:
        accepted: list[TcpChannel | None] = []
        thread = threading.Thread(
            target=lambda: accepted.append(listener.accept(peer=0, timeout_s=timeout_s, **options)), daemon=True
        )
        thread.start()
        connector = connect(listener.endpoints, peer=1, name=name, timeout_s=timeout_s, **options)
        thread.join(timeout_s)
    finally:
        listener.close()
    if connector is None or not accepted or accepted[0] is None:
        raise ChannelError(f"tcp pair {name}: the loopback pair did not join")
    return connector, accepted[0]
