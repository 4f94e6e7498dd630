"""The AFD rendezvous store: its key layout, the processes' incarnations and the pair handshake.

:class:`RendezvousStore` wraps the store on ``afd.host:afd.port`` (torch's TCPStore; with the
deployment's secret, :class:`~.guarded_store.GuardedStore`, which admits members only) and is the
only code that names a key in it; roles (:mod:`.pairs`, :mod:`.rejoin`, the FFN server) and serve's
supervisor (:mod:`afd_mrv2.serve.rendezvous`) go through its methods.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, final

import torch.distributed as dist

from afd_mrv2 import envs
from afd_mrv2.config import TRANSPORTS, AfdConfig
from afd_mrv2.errors import AfdError
from afd_mrv2.hooks.p2p import Pair, tcp_channel, zmq_channel
from afd_mrv2.hooks.p2p.channel import Channel, Endpoints
from afd_mrv2.hooks.p2p.gloo_channel import GlooChannel
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2.transport.guarded_store import GuardedStore
from afd_mrv2.placement import PlacementStamp
from afd_mrv2.ports import route_address

log = logging.getLogger(__name__)
#: Between a value and its MAC in the store, with a deployment secret.
_MAC_SEP = "\x1f"
#: Every key of the store lives under this prefix.
PREFIX = "afd_mrv2/p2p"
#: serve's own keys, for a deployment over several nodes.
SERVE = f"{PREFIX}/serve"
#: A pair group's own timeout (gloo aborts the whole group on expiry): a serving FFN rank waits as long as
#: its Attention engine stays idle, so a week; dead peers are noticed at once through the link's control channel.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
#: How often a side waiting for its peer's hello (or a newer incarnation) looks again.
POLL_S = 0.05
#: How long a zmq or tcp pair's sides wait for each other's token once both said hello.
TOKEN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PairTransport:
    """What a pair's channel runs on: ``kind`` (``gloo``: a two-rank gloo group through this store;
    ``zmq``: :mod:`afd_mrv2.hooks.p2p.zmq_channel`; ``tcp``: :mod:`afd_mrv2.hooks.p2p.tcp_channel`) and,
    for zmq and tcp, ``bind``: the address this side's sockets bind (``afd.bind``; None: the address of
    the route to the store's host)."""

    kind: str = "gloo"
    bind: str | None = None

    @classmethod
    def of(cls, config: AfdConfig) -> PairTransport:
        """``afd.transport`` and ``afd.bind`` of an ``afd`` section."""
        return cls(config.transport, config.bind)


class KeyValueStore(Protocol):
    """What :class:`RendezvousStore` asks of a store: torch's :class:`~torch.distributed.Store`, or a
    :class:`~.guarded_store.GuardedStore`."""

    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def add(self, key: str, value: int, /) -> int: ...
    def check(self, keys: list[str], /) -> bool: ...


class StrangerValue(AfdError):
    """A value in the store without the deployment's MAC: written by a process without its secret."""


class PlacementMismatch(AfdError):
    """The two sides of a pair hold different placement tables: raised on both sides, one line naming both."""


def _rank_name(role: str, index: int) -> str:
    """``a0`` for Attention rank 0, ``f1`` for FFN rank 1."""
    return f"{'a' if role == ATTENTION else 'f'}{index}"


def pair_name(attention: int, attention_incarnation: int, ffn: int, ffn_incarnation: int) -> str:
    """The name of the pair of two incarnations, ``a{a}.{i}-f{f}.{j}``: its store prefix, and how messages
    name it (:attr:`afd_mrv2.hooks.p2p.Pair.name`)."""
    return f"a{attention}.{attention_incarnation}-f{ffn}.{ffn_incarnation}"


@final
class RendezvousStore:
    """The rendezvous store of one AFD deployment, as the roles and serve use it.

    The key layout (under :data:`PREFIX`), private to this class:

    * ``{rank}/incarnation``: a counter each process of the rank bumps when it opens its link
      (:meth:`register`); ``{rank}`` is ``a{index}`` or ``f{index}``;
    * ``{rank}.{incarnation}/label``: that process's ``pid N on HOST``, for messages;
    * ``{rank}/lost``: the rank's incarnation serve last saw lost (:meth:`mark_lost`, :meth:`lost_incarnation`);
    * ``stop``: the deployment is stopping (:meth:`request_stop`);
    * ``{rank}/figures``: the rank's live figures, JSON (:meth:`publish_live`, every second);
    * ``{pair}/placement/{attention|ffn}``: that side's placement stamp, JSON (:meth:`join_pair`), set
      before its hello;
    * ``{pair}/hello/{attention|ffn}``: a side of a pair is there (:meth:`join_pair`);
    * ``{pair}/gloo/...``: the pair's gloo rendezvous (gloo's own keys);
    * ``{pair}/zmq/endpoint``, ``{pair}/tcp/endpoint``: on zmq or tcp, where the FFN side listens and the
      pair's token, JSON (:class:`~afd_mrv2.hooks.p2p.channel.Endpoints`), set by the FFN side before its
      hello;
    * ``serve/node{k}``, ``serve/node{k}/beat``: a serve over several nodes: node ``k``'s address and host
      (JSON), its heartbeat counter;
    * ``serve/{rank}/state``, ``serve/{rank}/signal``, ``serve/{rank}/restart``: the process of a role rank as
      its node sees it (JSON), a signal node 0 asks its node to send it (JSON), the launch (1, 2, ...) node 0
      asks its node to start (:mod:`afd_mrv2.serve.agent`).

    Sections: connection; incarnations; losses and the stop key; live figures; serve's nodes; the pair handshake.
    """

    __slots__ = ("_secret", "_store", "transport")

    def __init__(
        self, store: KeyValueStore, *, transport: PairTransport = PairTransport(), secret: bytes | None = None
    ) -> None:
        """Wrap an open ``store`` (:meth:`connect` opens one); it lives as long as this object.  Pairs this
        side joins run on ``transport``.  With the deployment's ``secret`` every value written carries its
        MAC and every value read must (:class:`StrangerValue`), and the zmq and tcp pairs' tokens derive from
        it; gloo pairs are refused then, at their join (gloo's own keys in the store carry no MAC)."""
        if transport.kind not in TRANSPORTS:
            raise ValueError(f"transport {transport.kind!r}: not one of {', '.join(TRANSPORTS)}")
        self._store = store
        self.transport = transport
        self._secret = secret

    # ------------------------------------------------------------------ connection

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        master: bool,
        timeout_s: float = 600.0,
        transport: PairTransport = PairTransport(),
        secret: bytes | None = None,
    ) -> RendezvousStore:
        """The store on ``host:port``: hosted here (``master``) or connected to (retrying until ``timeout_s``);
        pairs joined through it run on ``transport`` (a zmq or tcp one without ``bind`` binds the route to
        ``host``); guarded by ``secret``, else by ``$AFD_MRV2_SECRET`` where it is set: then the store is a
        :class:`~.guarded_store.GuardedStore` (members only), else torch's TCPStore (anyone)."""
        secret = secret if secret is not None else envs.secret()
        if transport.kind != "gloo" and transport.bind is None:
            transport = PairTransport(transport.kind, route_address(host, port))
        timeout = datetime.timedelta(seconds=timeout_s)
        store: KeyValueStore
        if secret is not None:
            store = GuardedStore(host, port, secret=secret, master=master, timeout=timeout)
        else:
            store = dist.TCPStore(host, port, is_master=master, timeout=timeout, wait_for_workers=False)
        return cls(store, transport=transport, secret=secret)

    # ------------------------------------------------------------------ incarnations

    def register(self, role: str, index: int) -> int:
        """This process as the next incarnation of ``role`` rank ``index`` (1, 2, ...); its label (pid, host)
        goes into the store for the peers' messages."""
        incarnation = int(self._store.add(self._counter(role, index), 1))
        self._set(self._label(role, index, incarnation), f"pid {os.getpid()} on {socket.gethostname()}")
        return incarnation

    def latest(self, role: str, index: int) -> int:
        """The latest incarnation of ``role`` rank ``index`` (0: none registered yet); never blocks."""
        return int(self._store.add(self._counter(role, index), 0))

    def label(self, role: str, index: int, incarnation: int) -> str:
        """``pid N on HOST`` of that incarnation (empty when it never registered)."""
        return self._get(self._label(role, index, incarnation)) or ""

    # ------------------------------------------------------------------ losses and the stop key

    def mark_lost(self, role: str, index: int) -> None:
        """Say that ``role`` rank ``index``'s latest incarnation is gone (serve, on a loss): a process that
        starts meanwhile (a restarted engine) does not wait for it, and joins its next incarnation later."""
        self._set(self._lost(role, index), str(self.latest(role, index)))

    def lost_incarnation(self, role: str, index: int) -> int:
        """The incarnation of ``role`` rank ``index`` last marked lost (0: none)."""
        return int(self._get(self._lost(role, index)) or 0)

    def request_stop(self) -> None:
        """Tell every role on this store that the deployment is stopping: FFN ranks then serve no new
        incarnation of an engine, and their sessions end once their engines left."""
        self._set(f"{PREFIX}/stop", "1")

    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called."""
        return self._get(f"{PREFIX}/stop") == "1"

    # ------------------------------------------------------------------ live figures

    def publish_live(self, role: str, index: int, doc: dict[str, Any]) -> None:
        """``role`` rank ``index``'s live figures, as :func:`afd_mrv2.live_stats.encode` made them (JSON)."""
        self._set(self._figures(role, index), json.dumps(doc, sort_keys=True))

    def live(self, role: str, index: int) -> dict[str, Any] | None:
        """What ``role`` rank ``index`` last published (None: nothing yet); never blocks."""
        return self._object(self._figures(role, index))

    # ------------------------------------------------------------------ serve's nodes (--nnodes)

    def announce_node(self, node: int, info: dict[str, Any]) -> None:
        """Node ``node``'s serve is up: its address, host name and pid (JSON)."""
        self._set(f"{SERVE}/node{node}", json.dumps(info, sort_keys=True))

    def node_info(self, node: int) -> dict[str, Any] | None:
        """What node ``node`` announced (None: not yet)."""
        return self._object(f"{SERVE}/node{node}")

    def beat(self, node: int) -> int:
        """One heartbeat of node ``node``'s serve; returns the count."""
        return int(self._store.add(f"{SERVE}/node{node}/beat", 1))

    def beats(self, node: int) -> int:
        """Node ``node``'s heartbeats so far (never blocks)."""
        return int(self._store.add(f"{SERVE}/node{node}/beat", 0))

    def publish_role(self, role: str, index: int, state: dict[str, Any]) -> None:
        """The process of ``role`` rank ``index`` as its node sees it: launch, pid, ready, exit (JSON)."""
        self._set(f"{SERVE}/{_rank_name(role, index)}/state", json.dumps(state, sort_keys=True))

    def role_state(self, role: str, index: int) -> dict[str, Any] | None:
        return self._object(f"{SERVE}/{_rank_name(role, index)}/state")

    def request_signal(self, role: str, index: int, launch: int, signum: int) -> None:
        """Ask the node of ``role`` rank ``index`` to send ``signum`` to that launch's process group."""
        seq = int(self._store.add(f"{SERVE}/{_rank_name(role, index)}/signals", 1))
        request = {"launch": launch, "signal": signum, "seq": seq}
        self._set(f"{SERVE}/{_rank_name(role, index)}/signal", json.dumps(request))

    def signal_request(self, role: str, index: int) -> dict[str, Any] | None:
        """The latest signal asked for ``role`` rank ``index`` (``launch``, ``signal``, ``seq``)."""
        return self._object(f"{SERVE}/{_rank_name(role, index)}/signal")

    def request_restart(self, role: str, index: int, launch: int) -> None:
        """Ask the node of ``role`` rank ``index`` to start its process ``launch`` (2, 3, ...)."""
        self._set(f"{SERVE}/{_rank_name(role, index)}/restart", str(launch))

    def restart_request(self, role: str, index: int) -> int:
        """The latest launch asked for ``role`` rank ``index`` (0: none)."""
        return int(self._get(f"{SERVE}/{_rank_name(role, index)}/restart") or 0)

    def _json(self, key: str) -> Any:
        text = self._get(key)
        return json.loads(text) if text is not None else None

    def _object(self, key: str) -> dict[str, Any] | None:
        value = self._json(key)
        return value if isinstance(value, dict) else None

    # ------------------------------------------------------------------ the pair handshake

    def join_pair(
        self,
        role: str,
        attention: tuple[int, int],
        ffn: tuple[int, int],
        *,
        placement: PlacementStamp,
        give_up: Callable[[], bool] = lambda: False,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> Pair | None:
        """Join the pair of Attention rank ``attention = (index, incarnation)`` and FFN rank ``ffn`` as ``role``.

        A handshake: write this side's ``placement`` stamp, say hello, wait (polling, so that it can give up)
        for the peer's hello, None when ``give_up()`` turns true first; then compare the stamps
        (:class:`PlacementMismatch` on both sides when they differ, one line naming both) and open the pair's
        channel on :attr:`transport`: gloo's rendezvous of the two (completes at once), or zmq's or tcp's token
        exchange (the FFN side listens and publishes where before its hello; on zmq a wrong token fails the
        join, on tcp a connection without the token is refused and logged while the FFN side waits on).
        The Attention rank is rank 0 of the pair.
        """
        if self._secret is not None and self.transport.kind == "gloo":
            raise AfdError(
                "afd.transport gloo cannot be guarded by the deployment's secret (gloo's own rendezvous keys "
                "carry no MAC): use tcp or zmq"
            )
        name = pair_name(*attention, *ffn)
        mine, theirs = ("attention", "ffn") if role == ATTENTION else ("ffn", "attention")
        me = 0 if role == ATTENTION else 1
        listening = self._listen(name) if role == FFN and self.transport.kind != "gloo" else None
        try:
            self._set(f"{PREFIX}/{name}/placement/{mine}", json.dumps([placement.digest, placement.summary]))
            self._set(f"{PREFIX}/{name}/hello/{mine}", "1")
            hello = f"{PREFIX}/{name}/hello/{theirs}"
            while not self._store.check([hello]):
                if give_up():
                    return None
                time.sleep(POLL_S)
            digest, summary = json.loads(self._value(f"{PREFIX}/{name}/placement/{theirs}"))
            peer = PlacementStamp(digest, summary)
            if peer != placement:
                stamps = (placement, peer) if role == ATTENTION else (peer, placement)
                raise PlacementMismatch(self._mismatch(name, attention, ffn, *stamps))
            if self.transport.kind != "gloo":
                channel = self._open_channel(name, listening, give_up)
                if channel is None:
                    return None
                if listening is not None and listening[0] is channel:
                    listening = None  # a zmq pair owns its bound socket (a tcp listener closes: the pair has its own)
                return Pair(channel, me, 1 - me, name)
            assert isinstance(self._store, dist.Store)  # a GuardedStore comes with a secret: gloo was refused
            gloo = dist.PrefixStore(f"{PREFIX}/{name}/gloo", self._store)
            group = dist.ProcessGroupGloo(gloo, me, 2, datetime.timedelta(seconds=idle_timeout_s))
            return Pair(GlooChannel(group, 1 - me), me, 1 - me, name)
        finally:
            if listening is not None:
                listening[0].close()

    def _listen(self, name: str) -> tuple[Any, Endpoints]:
        """The FFN side of a zmq or tcp pair: its socket bound (a zmq channel, a tcp listener) and the endpoints
        it checks; where it listens is published with the token, or (with a secret) with the nonce the token
        derives from (:meth:`_token`)."""
        nonce = secrets.token_hex(16)
        token = self._token(name, nonce)
        try:
            if self.transport.kind == "tcp":
                listener = tcp_channel.listen(name=name, bind=self._bind, token=token)
                opened: tuple[Any, Endpoints] = (listener, listener.endpoints)
            else:
                channel, bound = zmq_channel.listen(peer=0, name=name, bind=self._bind)
                opened = (channel, Endpoints(bound.endpoint, token))
        except Exception as exc:
            raise AfdError(f"afd.bind: cannot bind {self._bind!r} for pair {name}: {exc}") from exc
        self._set(f"{PREFIX}/{name}/{self.transport.kind}/endpoint", Endpoints(opened[1].endpoint, nonce).to_json())
        return opened

    def _open_channel(
        self, name: str, listening: tuple[Any, Endpoints] | None, give_up: Callable[[], bool]
    ) -> Channel | None:
        """Both hellos seen: the pair's zmq or tcp channel, or None when ``give_up()`` turned true first."""
        if self.transport.kind == "zmq":
            return self._zmq_channel(name, listening, give_up)
        if listening is not None:
            listener: tcp_channel.TcpListener = listening[0]
            return listener.accept(peer=0, timeout_s=TOKEN_TIMEOUT_S, give_up=give_up)
        endpoints = self._peer_endpoints(name)
        return tcp_channel.connect(
            endpoints, peer=1, name=name, timeout_s=TOKEN_TIMEOUT_S, give_up=give_up, bind=self._bind
        )

    def _zmq_channel(
        self,
        name: str,
        listening: tuple[Any, Endpoints] | None,
        give_up: Callable[[], bool],
    ) -> zmq_channel.ZmqChannel | None:
        """Both hellos seen: the Attention side connects to the published endpoint; both exchange the token
        (the FFN side checks the one it made, never what the store holds now); None when ``give_up()``
        turned true first."""
        if listening is not None:
            channel, endpoints = listening
        else:
            endpoints = self._peer_endpoints(name)
            channel = zmq_channel.connect(endpoints, peer=1, name=name, bind=self._bind)
        try:
            joined = zmq_channel.exchange_token(
                channel, endpoints.token, first=listening is None, timeout_s=TOKEN_TIMEOUT_S, give_up=give_up
            )
        except BaseException:
            if listening is None:
                channel.close()
            raise
        if not joined and listening is None:
            channel.close()
        return channel if joined else None

    @property
    def _bind(self) -> str:
        return self.transport.bind or "127.0.0.1"

    def _mismatch(
        self,
        name: str,
        attention: tuple[int, int],
        ffn: tuple[int, int],
        on_attention: PlacementStamp,
        on_ffn: PlacementStamp,
    ) -> str:
        """``placement mismatch on pair a0.1-f1.1: attention rank 0 (pid N on HOST) holds sha256:... (...);
        FFN rank 1 (pid M on HOST) holds sha256:... (...)``."""
        sides = [
            f"{who} rank {index} ({self.label(role, index, incarnation) or f'incarnation {incarnation}'}) holds "
            f"{stamp.short} ({stamp.summary})"
            for who, role, (index, incarnation), stamp in (
                ("attention", ATTENTION, attention, on_attention),
                ("FFN", FFN, ffn, on_ffn),
            )
        ]
        return f"placement mismatch on pair {name}: {'; '.join(sides)}"

    # ------------------------------------------------------------------ the key layout

    @staticmethod
    def _counter(role: str, index: int) -> str:
        return f"{PREFIX}/{_rank_name(role, index)}/incarnation"

    @staticmethod
    def _label(role: str, index: int, incarnation: int) -> str:
        return f"{PREFIX}/{_rank_name(role, index)}.{incarnation}/label"

    @staticmethod
    def _figures(role: str, index: int) -> str:
        return f"{PREFIX}/{_rank_name(role, index)}/figures"

    @staticmethod
    def _lost(role: str, index: int) -> str:
        return f"{PREFIX}/{_rank_name(role, index)}/lost"

    def _get(self, key: str) -> str | None:
        """The value of ``key``, None when it is not set or (with a secret) its MAC is wrong (never blocks)."""
        if not self._store.check([key]):
            return None
        try:
            return self._value(key)
        except StrangerValue as exc:
            log.warning("%s", exc)
            return None

    # ------------------------------------------------------------------ the deployment's secret

    def _set(self, key: str, value: str) -> None:
        """Write ``value``, with its MAC when the deployment has a secret."""
        self._store.set(key, value if self._secret is None else f"{value}{_MAC_SEP}{self._mac(key, value)}")

    def _value(self, key: str) -> str:
        """The value of ``key`` (waits for it, up to the store's timeout); :class:`StrangerValue` when the
        deployment has a secret and the value lacks its MAC (a process without the secret wrote it)."""
        raw = self._store.get(key).decode()
        if self._secret is None:
            return raw
        value, sep, mac = raw.rpartition(_MAC_SEP)
        if not sep or not hmac.compare_digest(mac, self._mac(key, value)):
            raise StrangerValue(f"rendezvous store: refused the value of {key}: it lacks the deployment's MAC "
                                "(a process without the deployment's secret wrote it)")  # fmt: skip
        return value

    def _mac(self, key: str, value: str) -> str:
        assert self._secret is not None
        return hmac.new(self._secret, f"{key}\n{value}".encode(), hashlib.sha256).hexdigest()[:32]

    def _token(self, name: str, nonce: str) -> str:
        """Pair ``name``'s token: with a secret, derived from it and the published ``nonce`` (the store holds
        only the nonce, so a reader of the store cannot present it); else the nonce itself."""
        if self._secret is None:
            return nonce
        return hmac.new(self._secret, f"pair {name} {nonce}".encode(), hashlib.sha256).hexdigest()[: len(nonce)]

    def _peer_endpoints(self, name: str) -> Endpoints:
        """Where the FFN side of pair ``name`` listens, with the token to present."""
        published = Endpoints.from_json(self._value(f"{PREFIX}/{name}/{self.transport.kind}/endpoint"))
        return Endpoints(published.endpoint, self._token(name, published.token))
