"""The channel under one pair of a PeerLink: how its bytes move (RFC 0007, decision 2).

A :class:`Channel` joins this process and one peer.  ``post`` starts a send or a receive of
one tensor under a tag and returns a :class:`~afd_mrv2.hooks.p2p.link.Pending`; receives of
one tag match the peer's sends of that tag in posting order.  ``await_done`` waits at most
``slice_s`` for one Pending (PeerLink checks cancellation, peers and deadlines between
slices).  A failed Pending has ``error`` set (a :class:`ChannelError`) and ``done_at``
(``time.perf_counter()``) when the failure was seen.  Once the connection closed, every
posted Pending and every later post fails with :class:`ChannelClosed`; ``lost`` holds that
error and ``lost_at`` when it was seen, which PeerLink orders losses by.
"""

from __future__ import annotations

from typing import Protocol

import torch

from afd_mrv2.hooks.p2p.link import Pending

__all__ = ["Channel", "ChannelClosed", "ChannelError", "Pending"]


class ChannelError(RuntimeError):
    """A transfer on a channel failed (a Pending's ``error``); the message is one line."""


class ChannelClosed(ChannelError):
    """The channel's connection closed: the peer died or closed its end."""


class Channel(Protocol):
    """One peer's transfers; see the module docstring."""

    @property
    def lost(self) -> ChannelError | None:
        """The error every Pending fails with once the connection closed; None while it is open."""
        ...

    @property
    def lost_at(self) -> float:
        """``time.perf_counter()`` when the loss was seen (``inf`` while the channel is open)."""
        ...

    def post(self, direction: str, tensor: torch.Tensor, tag: int, what: str) -> Pending:
        """Start sending (``direction="send"``) or receiving (``"recv"``) ``tensor`` under ``tag``."""
        ...

    def await_done(self, pending: Pending, slice_s: float) -> bool:
        """Wait at most ``slice_s`` for ``pending``; True once it is done (or failed)."""
        ...

    def close(self) -> None:
        """Release the connection; Pendings still posted fail with :class:`ChannelClosed`."""
        ...
