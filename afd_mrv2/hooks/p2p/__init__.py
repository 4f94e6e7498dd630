"""Building blocks of the ``torch_p2p`` connector (:mod:`afd_mrv2.hooks.p2p.torch_p2p`).

* :mod:`~afd_mrv2.hooks.p2p.wire`: tags, the typed control header, payload layouts;
* :mod:`~afd_mrv2.hooks.p2p.link`: ``PeerLink``, posted operations waited on with
  deadlines, and the control channel (abort / goodbye, dead-peer detection);
* :mod:`~afd_mrv2.hooks.p2p.attention` and :mod:`~afd_mrv2.hooks.p2p.ffn`: the
  phase logic of each role;
* :mod:`~afd_mrv2.hooks.p2p.common`: options, the ``model`` shape, the simulated link;
* :mod:`~afd_mrv2.hooks.p2p.errors`: errors that name the peer.
"""

from __future__ import annotations

from afd_mrv2.hooks.p2p.common import P2pOptions, P2pShape, parse_options
from afd_mrv2.hooks.p2p.errors import PeerAborted, PeerError, PeerLost, PeerTimeout, ProtocolError
from afd_mrv2.hooks.p2p.link import Pair, PeerLink

__all__ = [
    "P2pOptions",
    "P2pShape",
    "Pair",
    "PeerAborted",
    "PeerError",
    "PeerLink",
    "PeerLost",
    "PeerTimeout",
    "ProtocolError",
    "parse_options",
]
