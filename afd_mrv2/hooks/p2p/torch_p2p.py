"""``torch_p2p``: the reference AFD connector on torch.distributed point-to-point.

:class:`TorchP2pConnector`, registered under the ``afd_mrv2`` entry-point group as a
third-party connector would be.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.torch_p2p".
"""

from __future__ import annotations

from typing import ClassVar

from afd_mrv2.api import AttentionFailover, FfnFailover, SupportsFailover
from afd_mrv2.errors import PluginError
from afd_mrv2.hooks.p2p.attention import AttentionSide
from afd_mrv2.hooks.p2p.common import P2pShape, parse_options
from afd_mrv2.hooks.p2p.ffn import FfnSide
from afd_mrv2.hooks.p2p.link import PeerLink
from afd_mrv2.hooks.p2p.roundtrip import RoundTripAttentionSide
from afd_mrv2.hookspecs import ComputeFn, hookimpl
from afd_mrv2.plugins import ConnectorContext, FfnContext
from afd_mrv2.work import Work


class TorchP2pConnector(SupportsFailover):
    """The torch_p2p connector; see docs/internals/p2p-transport.md."""

    required_capability: ClassVar[str | None] = None  # torch.distributed only: any runtime pair
    hook_api_version: ClassVar[int] = 2
    carries_stage_identity: ClassVar[bool] = True  # every header names the layer and stage i of n

    def __init__(self, context: ConnectorContext) -> None:
        context = context.typed()
        link = context.need(context.p2p_link, "p2p_link")
        shape = context.need(context.model, "model")
        if not isinstance(link, PeerLink):
            raise PluginError(f"torch_p2p: resource 'p2p_link' must be a PeerLink, got {type(link).__name__}")
        if not isinstance(shape, P2pShape):
            raise PluginError(f"torch_p2p: resource 'model' must be a P2pShape, got {type(shape).__name__}")
        if context.role != link.role:
            raise PluginError(
                f"torch_p2p: afd.role is {context.role!r} but global rank {link.rank} is "
                f"{link.topology.describe(link.rank)}"
            )
        options = parse_options(context.config.extra)
        self.side: AttentionSide | FfnSide
        if isinstance(context, FfnContext):
            self.side = FfnSide(
                link,
                shape,
                options,
                peers=context.attention_peers,
                follow_stages=context.follow_stages,
                on_item=context.on_item,
                on_rows=context.on_rows,
            )
        elif context.sink is not None:  # an exchange owner: each item is one round trip
            source = context.need(context.source, "source")
            self.side = RoundTripAttentionSide(link, shape, options, source=source, sink=context.sink)
        else:  # the owner drives the layer loop: layer l-1's combine arrives in item l's recv
            self.side = AttentionSide(link, shape, options)

    def attention_failover(self) -> AttentionFailover | None:
        """The round-trip Attention side (it fails over); None on the FFN role and the layer-pipelined side."""
        return self.side if isinstance(self.side, RoundTripAttentionSide) else None

    def ffn_failover(self) -> FfnFailover | None:
        """The FFN side (it counts the re-sends it served); None on the Attention role."""
        return self.side if isinstance(self.side, FfnSide) else None

    @hookimpl
    def on_recv(self, work: Work) -> None:
        self.side.on_recv(work)

    @hookimpl
    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        self.side.on_compute(work, compute)

    @hookimpl
    def on_send(self, work: Work) -> None:
        self.side.on_send(work)

    @hookimpl
    def on_cleanup(self, work: Work, error: BaseException) -> None:
        del error
        self.side.on_cleanup(work)
