"""What both sides of torch_p2p share: options, the model shape, the simulated link.

:class:`P2pOptions` (``recv_timeout_s``, ``send_timeout_s``, ``sim_latency_us``,
``sim_bandwidth_gbps``, ``max_tokens``, ``quant``), :class:`P2pShape`.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.common".
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from afd_mrv2.hooks.p2p.link import PeerLink, Pending
from afd_mrv2.hooks.p2p.wire import DispatchLayout
from afd_mrv2.hooks.quant_modes import QUANT_MODES
from afd_mrv2.hooks.simlink import LinkModel, simulate_transfer
from afd_mrv2.options import integer, number, one_of, option, parse_section
from afd_mrv2.work import Work

_POSITIVE = number()
_NON_NEGATIVE = number(inclusive=True)


@dataclass(frozen=True)
class P2pShape:
    """The model dimensions torch_p2p sizes its buffers and checks its messages with.

    Provided by the owner as the ``model`` context field.  ``num_layers`` tells the
    attention side which items have nothing to receive (layer 0) and which have
    nothing to send (the epilogue item ``layer == num_layers`` that only combines
    the last layer's FFN output).
    """

    hidden_size: int
    top_k: int
    num_experts: int
    num_layers: int
    max_tokens: int


@dataclass(frozen=True)
class P2pOptions:
    """torch_p2p's ``afd.connector_extra_config`` (see docs/internals/p2p-transport.md), parsed by :func:`parse_options`.

    ``send_timeout_s`` left unset takes ``recv_timeout_s``; ``link`` is the
    simulated link, set when either ``sim_*`` option is.
    """

    recv_timeout_s: float = option(_POSITIVE, 30.0)
    send_timeout_s: float = option(_POSITIVE, None)  # None: recv_timeout_s (set in __post_init__)
    sim_latency_us: float | None = option(_NON_NEGATIVE, None)
    sim_bandwidth_gbps: float | None = option(_NON_NEGATIVE, None)  # 0 (the default): infinite
    max_tokens: int | None = option(integer(1), None)
    quant: str | None = option(one_of(QUANT_MODES), None)
    link: LinkModel | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # typed float for its readers, the field holds its default None (or a null key) until here
        if cast(float | None, self.send_timeout_s) is None:
            object.__setattr__(self, "send_timeout_s", self.recv_timeout_s)
        if self.sim_latency_us is not None or self.sim_bandwidth_gbps is not None:
            latency = (self.sim_latency_us or 0.0) * 1e-6
            object.__setattr__(self, "link", LinkModel(latency, latency, (self.sim_bandwidth_gbps or 0.0) * 1e9))


def parse_options(extra: Mapping[str, Any], key: str = "afd.connector_extra_config") -> P2pOptions:
    """Parse torch_p2p's ``connector_extra_config``; one :class:`ConfigError` per bad key."""
    return parse_section(P2pOptions, extra, key)


class Side:
    """What both roles' phase logic shares: the link, sizes, and deadline-bound waits."""

    def __init__(self, link: PeerLink, shape: P2pShape, options: P2pOptions) -> None:
        self.link = link
        self.shape = shape
        self.options = options
        self.capacity = options.max_tokens or shape.max_tokens
        self.layout = DispatchLayout(shape.hidden_size, shape.top_k, options.quant)
        #: the global ranks of the other role, in index order: every one is a peer of every item
        self.peers = link.topology.peers_of(link.rank)

    def wait(self, pendings: Sequence[Pending], work: Work, phase: str, action: str) -> None:
        """Wait for ``pendings`` under the deadline of ``phase`` (``recv`` or ``send``)."""
        option = f"{phase}_timeout_s"
        timeout = self.options.recv_timeout_s if phase == "recv" else self.options.send_timeout_s
        self.link.wait(pendings, timeout_s=timeout, work=work, action=action, option=option)


def charge_link(options: P2pOptions, work: Work, direction: str, pendings: Sequence[Pending]) -> None:
    """Hold the calling stream until the simulated link delivered ``pendings`` (no-op without a link).

    Per peer: delivery = first completion of that peer's operations + latency +
    their bytes / bandwidth; the stream waits for the last delivery.
    """
    link = options.link
    if link is None or not pendings:
        return
    started: dict[int, float] = {}
    nbytes: dict[int, int] = {}
    for p in pendings:
        started[p.peer] = min(started.get(p.peer, p.done_at), p.done_at)
        nbytes[p.peer] = nbytes.get(p.peer, 0) + p.nbytes
    delivered = max(started[peer] + link.cost_s(direction, nbytes[peer]) for peer in started)
    simulate_transfer(work, delivered - time.perf_counter())
