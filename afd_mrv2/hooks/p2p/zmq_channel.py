"""ZmqChannel: a :class:`~afd_mrv2.hooks.p2p.channel.Channel` on two zmq PAIR sockets (RFC 0007, 4-7).

One socket per direction.  A send is one message, a 12-byte envelope (tag u32, nbytes u64) and
the bytes, copied into zmq (the Pending is done on return).  No thread of ours reads: a waiter
in ``await_done`` takes the receive side (others wait on their Pending), reads every ready
message and completes the receives it belongs to, per tag in posting order; a message for a
tag with no posted receive is kept and copied in when one is posted.  A monitor reports a
disconnect: the messages already queued are read first, then every posted and later Pending
fails with :class:`ChannelClosed`.  ``listen`` / ``connect`` / ``exchange_token`` build a pair.
Each side binds its receiving socket (libzmq keeps a bound socket's queue on a disconnect, drops a
connecting one's): a peer's last message (its ABORT) is read after it left.  RFC 0007, amendment.
"""

from __future__ import annotations

import itertools
import math
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.channel import ChannelClosed, ChannelError, Endpoints, Pending
from afd_mrv2.hooks.p2p.reading import ReaderChannel, finish

_ENVELOPE = struct.Struct("<IQ")  # tag, nbytes
_HELLO = b"afd-zmq-token:"
_LOSS_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_IDS = itertools.count()


class ZmqChannel(ReaderChannel):
    """The transfers with one peer (global rank ``peer``) of the pair ``name``; see the module docstring."""

    transport = "zmq"

    def __init__(
        self, send: zmq.Socket[Any], recv: zmq.Socket[Any], *, peer: int, name: str,
        send_timeout_s: float = 30.0, max_kept: int = 64,
    ) -> None:  # fmt: skip
        super().__init__(peer=peer, name=name, send_timeout_s=send_timeout_s, max_kept=max_kept, flags=False)
        self._send, self._recv = send, recv
        self.endpoint = recv.get_string(zmq.LAST_ENDPOINT)  # where the peer sends ("" if not bound)
        # unique addresses: pyzmq's default names one by the socket's fd, which a later socket reuses
        self._monitors = [
            s.get_monitor_socket(_LOSS_EVENTS, f"inproc://afd-zmq-monitor-{next(_IDS)}") for s in (send, recv)
        ]

    # ------------------------------------------------------------------ posting

    def _post_send(self, pending: Pending, tag: int, view: memoryview) -> None:
        deadline, envelope = time.monotonic() + self._send_timeout_s, _ENVELOPE.pack(tag, pending.nbytes)
        with self._send_lock:
            while self.lost is None:
                try:
                    self._send.send_multipart([envelope, view], flags=zmq.NOBLOCK, copy=True)
                except zmq.Again:  # high-water mark, or no connection: wait for room, noticing a loss
                    if time.monotonic() >= deadline:
                        text = f"the peer did not accept {pending.what} within {self._send_timeout_s:g} s"
                        finish(pending, ChannelError(f"zmq pair {self.name}: {text}"))
                        return
                    self._send.poll(50, zmq.POLLOUT)
                    self._try_read()
                else:
                    finish(pending, None)
                    return
        finish(pending, self.lost)

    # ------------------------------------------------------------------ waiting

    def _read_until(self, pending: Pending, deadline: float) -> None:
        while not pending.done.is_set():
            left = deadline - time.monotonic()
            self._read(max(left, 0.0))
            if left <= 0:
                break

    def _try_read(self) -> None:
        if self._take_reader():
            try:
                self._read(0.0)
            finally:
                self._release_reader()

    def _read(self, timeout_s: float) -> None:
        """Poll up to ``timeout_s``, read every ready message, then act on a disconnect (the reader only).

        Only the receiving socket is polled; the monitors are looked at when that poll found nothing (a
        disconnected peer sends nothing more), which spares them on every message (about 8 us a round trip).
        """
        if self._recv.poll(math.ceil(timeout_s * 1000), zmq.POLLIN):
            if self._read_ready():
                self._wake_waiters()
        elif any(self._disconnected(m) for m in self._monitors):
            self._read_ready()  # what the peer sent before it left is read before the loss
            self._lose(ChannelClosed(f"zmq pair {self.name}: connection closed"))

    def _read_ready(self) -> bool:
        completed = False
        while self.lost is None and self._readable():  # no zmq.Again raised per read
            completed = self._read_message(self._recv.recv()) or completed
        return completed

    def _readable(self) -> bool:
        return bool(int(self._recv.get(zmq.EVENTS)) & zmq.POLLIN)

    def _read_message(self, envelope: bytes) -> bool:
        if len(envelope) != _ENVELOPE.size or not self._recv.get(zmq.RCVMORE):
            self._lose(ChannelError(f"zmq pair {self.name}: a malformed message ({len(envelope)}-byte envelope)"))
            return True
        tag, nbytes = _ENVELOPE.unpack(envelope)
        pending = self._take_posted(tag)
        if pending is None:
            return self._keep(tag, self._recv.recv(copy=False).buffer)
        if nbytes != pending.nbytes:
            self._recv.recv(copy=False)
            finish(pending, self._mismatch(pending, tag, nbytes))
            return True
        got = self._recv.recv_into(wire.host_bytes(pending.tensor))
        finish(pending, None if got == nbytes else self._mismatch(pending, tag, got))
        return True

    def _disconnected(self, monitor: zmq.Socket[Any]) -> bool:
        events = 0
        while monitor.poll(0):
            events |= recv_monitor_message(monitor)["event"]
        return bool(events & _LOSS_EVENTS)

    def close(self) -> None:
        """Close the sockets (once; a second call does nothing); Pendings still posted fail."""
        if not self._close_reading():
            return
        self._lose(ChannelClosed(f"{self._pair}: connection closed by this side"))
        for sock in (self._send, self._recv):
            sock.disable_monitor()
            sock.close()
        for sock in self._monitors:
            sock.close()


# ---------------------------------------------------------------------- building a pair


#: what the binding side publishes (one class for every channel's handshake)
ZmqEndpoints = Endpoints


def _channel(bind: str, linger_s: float, peer: int, name: str, **options: Any) -> ZmqChannel:
    context: zmq.Context[Any] = zmq.Context.instance()
    send: zmq.Socket[Any] = context.socket(zmq.PAIR)
    recv: zmq.Socket[Any] = context.socket(zmq.PAIR)
    for sock in (send, recv):
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one incarnation: never reconnect to whoever reuses the port
        sock.setsockopt(zmq.LINGER, round(linger_s * 1000))
        sock.setsockopt(zmq.IMMEDIATE, 1)
    recv.bind_to_random_port(f"tcp://{bind}")
    return ZmqChannel(send, recv, peer=peer, name=name, **options)


def listen(
    *, peer: int, name: str, bind: str = "127.0.0.1", linger_s: float = 0.25, **options: Any
) -> tuple[ZmqChannel, ZmqEndpoints]:
    """The binding side (the FFN's): its receiving socket on an ephemeral port of ``bind``, a fresh token."""
    channel = _channel(bind, linger_s, peer, name, **options)
    return channel, ZmqEndpoints(channel.endpoint, secrets.token_hex(16))


def connect(
    endpoints: ZmqEndpoints, *, peer: int, name: str, bind: str = "127.0.0.1", linger_s: float = 0.25, **options: Any
) -> ZmqChannel:
    """The connecting side (the Attention's): binds its receiving socket on ``bind``, sends to ``endpoints``."""
    channel = _channel(bind, linger_s, peer, name, **options)
    channel._send.connect(endpoints.endpoint)
    return channel


def _token_step(channel: ZmqChannel, send: bytes | None, deadline: float, give_up: Callable[[], bool]) -> bytes:
    sock, event = (channel._send, zmq.POLLOUT) if send is not None else (channel._recv, zmq.POLLIN)
    while not sock.poll(50, event):
        if give_up():
            return b""
        if time.monotonic() >= deadline:
            raise ChannelError(f"zmq pair {channel.name}: no token from the peer in time")
    if send is not None:
        sock.send(send)
        return send
    return bytes(sock.recv())


def exchange_token(
    channel: ZmqChannel, token: str, *, first: bool, timeout_s: float, give_up: Callable[[], bool] = lambda: False
) -> bool:
    """Before any post: the connecting side (``first``) sends ``token`` and where it receives; the
    binding side checks the token, connects there and sends it back, which the connecting side
    checks.  False when ``give_up()`` turned true first; raises :class:`ChannelError` (one line naming
    the pair) on a wrong token or none in ``timeout_s``."""
    deadline, hello = time.monotonic() + timeout_s, _HELLO + token.encode()
    if first and not _token_step(channel, hello + b"@" + channel.endpoint.encode(), deadline, give_up):
        return False
    got = _token_step(channel, None, deadline, give_up)
    if not got:
        return False
    got_hello, _, endpoint = got.partition(b"@")
    if got_hello != hello or (not first and not endpoint):
        raise ChannelError(f"zmq pair {channel.name}: the peer sent a wrong token (not this pair's peer)")
    if not first:
        channel._send.connect(endpoint.decode())
        return bool(_token_step(channel, hello, deadline, give_up))
    return True


def loopback_pair(*, name: str = "a0-f0", timeout_s: float = 10.0, **options: Any) -> tuple[ZmqChannel, ZmqChannel]:
    """A joined pair on 127.0.0.1 in this process, for tests and benches: (connecting side, binding side)."""
    binder, endpoints = listen(peer=0, name=name, **options)
    connector = connect(endpoints, peer=1, name=name, **options)
    deadline, hello = time.monotonic() + timeout_s, _HELLO + endpoints.token.encode()
    _token_step(connector, hello + b"@" + connector.endpoint.encode(), deadline, lambda: False)
    exchange_token(binder, endpoints.token, first=False, timeout_s=timeout_s)
    if _token_step(connector, None, deadline, lambda: False) != hello:
        raise ChannelError(f"zmq pair {name}: the peer sent a wrong token (not this pair's peer)")
    return connector, binder
