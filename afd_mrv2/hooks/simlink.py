"""``simlink``: a simulated link, for controlled overlap experiments and the demo.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.simlink".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from afd_mrv2.hookspecs import ComputeFn, hookimpl
from afd_mrv2.items import WorkItem
from afd_mrv2.options import number, option, parse_section
from afd_mrv2.plugins import ConnectorContext
from afd_mrv2.work import Work

_SLEEP_CHUNK_S = 0.05  # re-check cancellation at least this often
_NON_NEGATIVE = number(inclusive=True)


@dataclass(frozen=True)
class SimLinkOptions:
    """simlink's ``afd.connector_extra_config``; see docs/internals/p2p-transport.md."""

    latency_us: float = option(_NON_NEGATIVE, 50.0)
    recv_latency_us: float | None = option(_NON_NEGATIVE, None)  # None: latency_us
    send_latency_us: float | None = option(_NON_NEGATIVE, None)  # None: latency_us
    bandwidth_gbps: float = option(_NON_NEGATIVE, 10.0)


@dataclass(frozen=True)
class LinkModel:
    """Cost of one simulated transfer: latency + bytes / bandwidth."""

    recv_latency_s: float
    send_latency_s: float
    bytes_per_s: float  # 0: infinite bandwidth

    def cost_s(self, direction: str, nbytes: int) -> float:
        latency = self.recv_latency_s if direction == "recv" else self.send_latency_s
        return latency + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], key: str = "afd.connector_extra_config") -> LinkModel:
        """The link of simlink's ``connector_extra_config`` (:class:`SimLinkOptions`)."""
        opts = parse_section(SimLinkOptions, options, key)
        return cls(
            recv_latency_s=(opts.latency_us if opts.recv_latency_us is None else opts.recv_latency_us) * 1e-6,
            send_latency_s=(opts.latency_us if opts.send_latency_us is None else opts.send_latency_us) * 1e-6,
            bytes_per_s=opts.bandwidth_gbps * 1e9,
        )


def simulate_transfer(work: Work, seconds: float) -> None:
    """Sleep ``seconds`` (no CPU), waking to honour cancellation."""
    end = time.perf_counter() + seconds
    while True:
        work.raise_if_cancelled()
        remaining = end - time.perf_counter()
        if remaining <= 0:
            return
        time.sleep(min(remaining, _SLEEP_CHUNK_S))


def _into(buffer: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``buffer``, reallocated only when shape or dtype changed."""
    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
        buffer = torch.empty_like(value)
    return buffer.copy_(value)


class SimLinkConnector:
    """The simulated-link connector; see docs/internals/p2p-transport.md."""

    required_capability: ClassVar[str | None] = None  # runs on any runtime pair
    hook_api_version: ClassVar[int] = 2

    def __init__(self, context: ConnectorContext) -> None:
        context = context.typed()
        self.link = LinkModel.from_options(context.config.extra)
        self._source: Callable[[WorkItem], torch.Tensor] = context.need(context.source, "source")
        self._sink: Callable[[WorkItem, torch.Tensor], None] = context.need(context.sink, "sink")

    @hookimpl
    def on_recv(self, work: Work) -> None:
        incoming = self._source(work.item)
        simulate_transfer(work, self.link.cost_s("recv", incoming.numel() * incoming.element_size()))
        work.inputs.state = _into(work.inputs.state, incoming)

    @hookimpl
    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        work.outputs.state = _into(work.outputs.state, compute(work.item, work.inputs.state))

    @hookimpl
    def on_send(self, work: Work) -> None:
        outputs = work.outputs.state
        simulate_transfer(work, self.link.cost_s("send", outputs.numel() * outputs.element_size()))
        self._sink(work.item, outputs.clone())

    @hookimpl
    def on_cleanup(self, work: Work, error: BaseException) -> None:
        del work, error  # the buffers stay with their slots; nothing per item to release
