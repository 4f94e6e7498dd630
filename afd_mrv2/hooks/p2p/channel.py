"""The channel under one pair of a PeerLink: how its bytes move (RFC 0007, decision 2).

A :class:`Channel` joins this process and one peer.  ``post`` starts a send or a receive of
one tensor under a tag and returns a :class:`Pending`; receives of one tag match the peer's
sends of that tag in posting order.  ``await_done`` waits at most ``slice_s`` for one Pending
(PeerLink checks cancellation, peers and deadlines between slices; ``slice_s=0`` only looks).
A failed Pending has ``error`` set and ``done_at`` (``time.perf_counter()``) when the failure
was seen.  Implementations: :class:`~afd_mrv2.hooks.p2p.gloo_channel.GlooChannel` (a
torch.distributed group), :class:`~afd_mrv2.hooks.p2p.zmq_channel.ZmqChannel` and
:class:`~afd_mrv2.hooks.p2p.tcp_channel.TcpChannel`.  :class:`Endpoints` is what a listening
side publishes for its peer (through the rendezvous store).
"""

from __future__ import annotations

import abc
import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["Channel", "ChannelClosed", "ChannelError", "Endpoints", "Flag", "Pending"]


class ChannelError(RuntimeError):
    """A transfer on a channel failed (a Pending's ``error``); the message is one line."""


class ChannelClosed(ChannelError):
    """The channel's connection closed: the peer died or closed its end."""


class Flag:
    """A set-once flag with :class:`threading.Event`'s ``is_set`` / ``set`` / ``wait``, for the channels
    whose waiter reads (tcp): it is set by the reading thread, and a thread waits for it through the
    channel's ``await_done`` (which wakes it), so it needs no lock of its own.  Making one costs a tenth
    of an Event, which matters at three per round trip and side.  ``wait`` itself only looks every
    millisecond (for callers that wait on a Pending without its channel)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.001)
        return self._set


class Pending:
    """One posted send or receive of ``tensor``; ``done`` is set once it completed or failed (``error``).

    Holds the tensor until then, so a transport never writes into freed memory even when the hook
    that posted it has given up.  ``posted_at`` / ``done_at`` are ``time.perf_counter()`` stamps.
    """

    __slots__ = (
        "channel", "direction", "done", "done_at", "error", "nbytes", "peer", "posted_at", "tag", "tensor", "what",
        "work",
    )  # fmt: skip

    def __init__(
        self,
        work: Any,
        direction: str,
        tensor: torch.Tensor,
        peer: int,
        what: str,
        channel: Channel | None = None,
        done: threading.Event | Flag | None = None,
    ) -> None:
        self.work = work
        self.channel = channel
        self.direction = direction
        self.tensor = tensor
        self.peer = peer
        self.what = what
        self.nbytes = tensor.numel() * tensor.element_size()
        self.done = threading.Event() if done is None else done
        self.posted_at = 0.0
        self.done_at = 0.0  # when it completed (the simulated link starts there), or its failure was seen
        self.error: BaseException | None = None
        self.tag = -1  # the tag it was posted under, where the channel records it (the readers' channels)

    def await_done(self, slice_s: float) -> bool:
        """Wait at most ``slice_s`` for this operation through its channel; True once done (or failed)."""
        if self.channel is None:
            return self.done.wait(slice_s)
        return self.channel.await_done(self, slice_s)


class Channel(abc.ABC):
    """One peer's transfers; see the module docstring."""

    #: what the channel's errors name in PeerLink's messages (``[gloo: ...]``)
    transport = ""

    @abc.abstractmethod
    def post(self, direction: str, tensor: torch.Tensor, tag: int, what: str) -> Pending:
        """Start sending (``direction="send"``) or receiving (``"recv"``) ``tensor`` under ``tag``."""

    @abc.abstractmethod
    def await_done(self, pending: Pending, slice_s: float) -> bool:
        """Wait at most ``slice_s`` for ``pending``; True once it is done (or failed)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection; Pendings still posted fail (or end on their own, on gloo)."""


@dataclass(frozen=True)
class Endpoints:
    """What a pair's listening side publishes: where its peer reaches it, and the pair's token."""

    endpoint: str
    token: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Endpoints:
        return cls(**json.loads(text))
