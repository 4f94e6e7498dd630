"""Errors of the torch_p2p transport, each naming the peer it concerns.

A phase hook raises one of these; the executor wraps it in a
:class:`~afd_mrv2.errors.PipelineError` naming the work item and phase, so the
chain a user sees reads "on_recv failed for work item layer=2 stage=0 seq=9:
PeerLost: FFN rank 1 (global rank 3) closed the connection ...".
"""

from __future__ import annotations

from afd_mrv2.errors import AfdError


class PeerError(AfdError):
    """A transfer with ``peer`` (a global rank) failed; ``peer_name`` is its description."""

    def __init__(self, message: str, *, peer: int, peer_name: str) -> None:
        super().__init__(message)
        self.peer = peer
        self.peer_name = peer_name


class PeerLost(PeerError):
    """The peer's connection closed: the process died or tore down its process group."""


class PeerTimeout(PeerError):
    """The peer is connected but sent (or accepted) nothing before the configured deadline."""


class PeerAborted(PeerError):
    """The peer failed on its own and told us so on the control channel."""


class ProtocolError(PeerError):
    """A control header from ``peer`` failed validation; ``field`` names the offending field."""

    def __init__(self, message: str, *, peer: int, peer_name: str, field: str) -> None:
        super().__init__(message, peer=peer, peer_name=peer_name)
        self.field = field
