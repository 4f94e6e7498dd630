"""PeerLink: point-to-point transfers waited on safely, over one channel per peer.

:class:`PeerLink` (one group, or scoped :class:`Pair` s, each on a gloo or zmq channel), with its control channel.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.link".
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.channel import Channel, Pending
from afd_mrv2.hooks.p2p.errors import PeerAborted, PeerError, PeerLost, PeerTimeout
from afd_mrv2.hooks.p2p.gloo_channel import GlooChannel
from afd_mrv2.topology import Topology
from afd_mrv2.work import Work

_SLICE_S = 0.05  # how often a wait re-checks cancellation, peers and its deadline
_SETTLE_S = 0.25  # how long a lost peer's ABORT may take to be handed over (see _raise_if_it_said_why)
_LINGER_S = 0.25  # how long an aborting rank waits for its notice to be read before it may exit (see abort)


@dataclass(frozen=True)
class Pair:
    """A channel joining this rank and one peer: ``me`` and ``peer`` are the two ranks of the pair
    (0 and 1); ``name`` names it in messages (``a0.1-f1.2``: the two processes' incarnations).

    ``channel`` is a :class:`~afd_mrv2.hooks.p2p.channel.Channel`; a torch.distributed group given
    there (the shape before 0.3.0) is wrapped in a :class:`GlooChannel` with a ``DeprecationWarning``.
    """

    channel: Any
    me: int
    peer: int
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.channel, Channel):
            warnings.warn(
                "Pair(group, ...) is deprecated: give it a Channel (GlooChannel(group, peer))",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "channel", GlooChannel(self.channel, self.peer))

    @property
    def group(self) -> Any:
        """Deprecated: the process group of a gloo pair's channel (None on another transport)."""
        warnings.warn("Pair.group is deprecated: use Pair.channel", DeprecationWarning, stacklevel=2)
        return self.channel.group if isinstance(self.channel, GlooChannel) else None

    @property
    def generation(self) -> str:
        """Deprecated: the pair's :attr:`name`."""
        warnings.warn("Pair.generation is deprecated: use Pair.name", DeprecationWarning, stacklevel=2)
        return self.name


class PeerLink:
    """Transfers between this rank and its peers; see docs/internals/p2p-transport.md.

    :param topology: the AFD rank map.
    :param rank: this process's global rank in ``group``.
    :param group: the torch.distributed process group of every rank (None: the default group).
    :param labels: optional extra description per global rank (``"pid 123 on host"``),
        appended wherever a peer is named.
    :param pairs: instead of ``group``: one :class:`Pair` per peer (global rank) this link
        talks to, each on its own :class:`~afd_mrv2.hooks.p2p.channel.Channel`; the link's peers
        are then exactly these.
    :param scoped: whether a wait fails only for the peers it waits on (default: on pairs yes,
        on one group no, since one dead rank breaks the whole group).
    """

    def __init__(
        self,
        topology: Topology,
        rank: int,
        group: Any = None,
        *,
        labels: Mapping[int, str] | None = None,
        pairs: Mapping[int, Pair] | None = None,
        scoped: bool | None = None,
    ) -> None:
        if group is not None and pairs is not None:
            raise ValueError("a PeerLink runs on one group or on pairs, not both")
        self.topology = topology
        self.rank = rank
        self.group = group
        self._on_pairs = pairs is not None
        self._scoped = self._on_pairs if scoped is None else scoped
        if pairs is None:
            whole = group if group is not None else dist.group.WORLD
            others = [p for p in range(topology.world_size) if p != rank]
            pairs = {p: Pair(GlooChannel(whole, p), rank, p) for p in others}
        self._pairs: dict[int, Pair] = dict(pairs)
        self.labels = dict(labels or {})
        self.role, self.index = topology.role_of(rank)
        self._lock = threading.Lock()
        self._control: dict[int, Pending] = {}
        #: peers counted as lost by someone who knows better than their connection (a partition): why
        self._declared: dict[int, str] = {}
        for peer in list(self._pairs):
            self._listen(peer)

    def _listen(self, peer: int) -> None:
        """Post the control receive from ``peer`` (at start, and on a new pair)."""
        buffer = torch.zeros(wire.CONTROL_BYTES, dtype=torch.uint8)
        self._control[peer] = self._post("recv", buffer, peer, wire.TAG_CONTROL, "control message")

    @property
    def peers(self) -> list[int]:
        """The global ranks this link talks to."""
        return sorted(self._control)

    @property
    def scoped(self) -> bool:
        """Whether a wait fails only for the peers it waits on (see docs/internals/p2p-transport.md)."""
        return self._scoped

    def pair_name(self, peer: int) -> str:
        """The name of ``peer``'s pair (empty on a one-group link)."""
        pair = self._pairs.get(peer)
        return pair.name if pair is not None else ""

    def generation(self, peer: int) -> str:
        """Deprecated: :meth:`pair_name`."""
        warnings.warn("PeerLink.generation is deprecated: use PeerLink.pair_name", DeprecationWarning, stacklevel=2)
        return self.pair_name(peer)

    def install(self, peer: int, pair: Pair, label: str | None = None) -> None:
        """Talk to ``peer`` over ``pair`` from now on (a restarted peer's new pair), with a fresh control
        channel; the old pair's channel is closed (on gloo, what was posted on it ends on its own)."""
        if not self._on_pairs:
            raise RuntimeError(f"{self.me}: a link on one process group cannot take a new pair")
        with self._lock:
            old = self._pairs.get(peer)
            self._pairs[peer] = pair
            self._declared.pop(peer, None)
            if label is not None:
                self.labels[peer] = label
        if old is not None and old.channel is not pair.channel:
            old.channel.close()
        self._listen(peer)

    # ------------------------------------------------------------------ naming

    def describe(self, peer: int) -> str:
        label = self.labels.get(peer)
        return f"{self.topology.describe(peer)}{', ' + label if label else ''}"

    @property
    def me(self) -> str:
        return self.describe(self.rank)

    # ------------------------------------------------------------------ posting

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Pending:
        return self._post("send", tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Pending:
        return self._post("recv", tensor, peer, tag, what)

    def lose(self, peer: int, reason: str) -> None:
        """Count ``peer`` as lost from now on, for ``reason``, though its connection may look open (a cut
        link sends no reset): the waits that depend on it and every post to it raise :class:`PeerLost`
        naming ``reason``, until a new pair with it is installed (:meth:`install`)."""
        with self._lock:
            self._declared[peer] = reason

    def _declared_loss(self, peer: int, reason: str) -> PeerLost:
        return PeerLost(f"{self.me}: lost {self.describe(peer)}: {reason}", peer=peer, peer_name=self.describe(peer))

    def _post(self, direction: str, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Pending:
        declared = self._declared.get(peer)
        if declared is not None:
            raise self._declared_loss(peer, declared)
        pair = self._pairs.get(peer)
        if pair is None:
            raise PeerLost(
                f"{self.me}: no pair with {self.describe(peer)} during {what}", peer=peer, peer_name=self.describe(peer)
            )
        try:
            pending: Pending = pair.channel.post(direction, tensor, tag, what)
        except RuntimeError as exc:  # the pair is already closed
            raise self._lost(peer, what, exc) from exc
        pending.peer = peer  # the global rank, whatever the channel calls its peer
        return pending

    # ------------------------------------------------------------------ waiting

    def wait(
        self, pendings: Sequence[Pending], *, timeout_s: float, work: Work | None, action: str, option: str
    ) -> None:
        """Wait until every operation completed; raise a :class:`PeerError` naming the peer otherwise.

        :param timeout_s: the deadline for all of them together.
        :param work: the work item whose cancellation aborts the wait (None: none).
        :param action: what the caller is doing, for messages (``"receiving layer=1 ..."``).
        :param option: the connector option holding ``timeout_s``, for messages.
        """
        deadline = time.monotonic() + timeout_s
        for pending in pendings:
            if not pending.await_done(_SLICE_S):  # the scope is made only here and for an error: most are done
                scope = self._scope({p.peer for p in pendings})
                while True:
                    if work is not None:
                        work.raise_if_cancelled()
                    self.check_peers(scope)
                    if time.monotonic() >= deadline:
                        raise self._timeout(pending, f"within {timeout_s:g} s ({option}) while {action}")
                    if pending.await_done(_SLICE_S):
                        break
            if pending.error is not None:
                self._raise_earlier_loss(pending.done_at, self._scope({p.peer for p in pendings}))
                self._raise_if_it_said_why(pending.peer)
                raise self._lost(pending.peer, f"{pending.what} while {action}", pending.error) from pending.error

    def _timeout(self, pending: Pending, within: str) -> PeerTimeout:
        verb = "sent no" if pending.direction == "recv" else "did not accept the"
        return PeerTimeout(
            f"{self.me}: {self.describe(pending.peer)} is connected but {verb} {pending.what} {within}: "
            "the peer is stalled, deadlocked, or running a different schedule",
            peer=pending.peer,
            peer_name=self.describe(pending.peer),
        )

    def _scope(self, peers: Collection[int] | None) -> Collection[int] | None:
        """The peers whose loss counts for a caller that depends on ``peers``: those on a scoped link,
        every peer (None) otherwise."""
        return peers if self.scoped else None

    def check_peers(self, peers: Collection[int] | None = None) -> None:
        """Raise if a peer died (the first to die) or aborted (then); peers that said BYE are fine.

        :param peers: the peers the caller depends on; on a scoped link only their loss counts
            (None, or an unscoped link: every peer's).
        """
        peers = self._scope(peers)
        for peer, pending in list(self._control.items()):
            if peers is None or peer in peers:
                pending.await_done(0.0)  # a channel whose waiter reads (zmq) reads what is there
        self._raise_earlier_loss(float("inf"), peers)
        for peer, reason in list(self._declared.items()):
            if peers is None or peer in peers:
                raise self._declared_loss(peer, reason)
        aborted: tuple[int, str] | None = None
        for peer, pending in self._control.items():
            if peers is not None and peer not in peers:
                continue
            if not pending.done.is_set() or pending.error is not None:
                continue
            header = wire.Header.read(wire.header_view(pending.tensor))
            if header.kind == wire.KIND_ABORT and aborted is None:
                aborted = (peer, wire.decode_control_text(pending.tensor))
        if aborted is not None:
            peer, text = aborted
            raise PeerAborted(
                f"{self.me}: {self.describe(peer)} aborted the run: {text}", peer=peer, peer_name=self.describe(peer)
            )

    def _raise_if_it_said_why(self, peer: int, settle_s: float = _SETTLE_S) -> None:
        """A peer whose connection closed after it sent ABORT said why it left (its reason names
        the root cause, e.g. the rank it lost): raise that instead of a bare loss.

        Its ABORT arrives before its connection closes, but the control channel may not have
        handed it over yet when a data operation's failure is seen: wait up to
        ``settle_s`` for it.  Without this, a rank that exchanges data only with the peer that
        failed second (because of the first) named that peer, not the first, under load.
        """
        control = self._control.get(peer)
        if control is None or not control.await_done(settle_s) or control.error is not None:
            return
        if self._kind(control) == wire.KIND_ABORT:
            raise PeerAborted(
                f"{self.me}: {self.describe(peer)} aborted the run: {wire.decode_control_text(control.tensor)}",
                peer=peer,
                peer_name=self.describe(peer),
            )

    def _raise_earlier_loss(self, before: float, peers: Collection[int] | None = None) -> None:
        """Raise PeerLost for the peer whose connection closed first, if that was before ``before``
        (among ``peers``; None: every peer).

        When one process dies, the ranks that then fail because of it close their
        connections too; naming the earliest loss names the root cause.
        """
        lost = [
            (p.done_at, peer, p.error)
            for peer, p in self._control.items()
            if p.done.is_set() and p.error is not None and (peers is None or peer in peers)
        ]
        if lost:
            done_at, peer, error = min(lost, key=lambda entry: entry[0])
            if done_at <= before:
                raise self._lost(peer, "its control channel", error) from error

    def _lost(self, peer: int, what: str, error: BaseException) -> PeerLost:
        detail = str(error).split(". This is typically", 1)[0].strip()
        pair = self._pairs.get(peer)
        transport = pair.channel.transport if pair is not None else "gloo"
        return PeerLost(
            f"{self.me}: lost {self.describe(peer)}: its connection closed (the process died or left the "
            f"process group) during {what} [{transport}: {detail}]",
            peer=peer,
            peer_name=self.describe(peer),
        )

    # ------------------------------------------------------------------ control channel

    def abort(self, reason: str, timeout_s: float = 1.0, linger_s: float = _LINGER_S) -> None:
        """Tell every reachable peer that this rank failed, waiting at most ``timeout_s``.

        Then, when a notice went out, linger ``linger_s`` before returning: the
        caller usually exits next, and a process that closes a connection with
        unread data in it resets the connection, which makes the peer drop what
        it had not read yet, the notice included ("Connection reset by peer",
        no reason).  The pause lets every peer's control watcher take the notice
        first, so a rank that only talks to this one still learns the root cause.
        """
        sends = []
        for peer, pending in self._control.items():
            if pending.await_done(0.0) and (pending.error is not None or self._kind(pending) == wire.KIND_BYE):
                continue
            buffer = torch.empty(wire.CONTROL_BYTES, dtype=torch.uint8)
            wire.encode_control(buffer, self._header(wire.KIND_ABORT, peer), f"{self.me}: {reason}")
            try:
                sends.append(self.isend(buffer, peer, wire.TAG_CONTROL, "abort notice"))
            except PeerError:
                continue
        deadline = time.monotonic() + timeout_s
        for pending in sends:
            pending.await_done(max(0.0, deadline - time.monotonic()))
        if any(p.done.is_set() and p.error is None for p in sends):
            time.sleep(linger_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Say BYE to every peer and wait for theirs: after this no message is in flight."""
        sends = []
        for peer in self._control:
            buffer = torch.empty(wire.CONTROL_BYTES, dtype=torch.uint8)
            wire.encode_control(buffer, self._header(wire.KIND_BYE, peer), "")
            sends.append(self.isend(buffer, peer, wire.TAG_CONTROL, "goodbye"))
        deadline = time.monotonic() + timeout_s
        for peer, pending in self._control.items():
            while not pending.await_done(_SLICE_S):
                self.check_peers()
                if time.monotonic() >= deadline:
                    raise PeerTimeout(
                        f"{self.me}: {self.describe(peer)} did not say goodbye within {timeout_s:g} s",
                        peer=peer,
                        peer_name=self.describe(peer),
                    )
            self.check_peers()
        self.wait(sends, timeout_s=max(0.1, deadline - time.monotonic()), work=None, action="closing", option="close")

    def release(self) -> None:
        """Close every pair's channel (after :meth:`close` or :meth:`abort`: the link is done); a zmq channel
        frees its sockets here, a gloo one leaves its group to its owner."""
        for pair in list(self._pairs.values()):
            pair.channel.close()

    def _header(self, kind: int, peer: int) -> wire.Header:
        return wire.Header(kind=kind, src=self.rank, dst=peer, layer=-1, stage=-1, seq=-1, tokens=0)

    @staticmethod
    def _kind(pending: Pending) -> int:
        return wire.Header.read(wire.header_view(pending.tensor)).kind
