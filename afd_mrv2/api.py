"""The public hook API: everything a connector or observer may use, and its version.

Markers ``hookimpl`` / ``hookspec``; the five hook specs (:mod:`afd_mrv2.hookspecs`) and
``ComputeFn``; ``Work``, ``BufferSlot``, ``WorkItem``; the contexts ``AttentionContext``,
``FfnContext``, ``ConnectorContext``, ``role_context``; the capabilities ``SupportsFailover``
and ``InFlightSink`` with their checks; ``Stream``, ``Event``, ``DeviceBackend``; the errors;
``HOOK_API_VERSION``, ``OLDEST_SERVED_HOOK_API``; and :mod:`afd_mrv2.options`.  Anything not
listed here is internal.

See docs/internals/hooks-api.md, "afd_mrv2.api".
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from afd_mrv2.devices.base import DeviceBackend, Event, Stream
from afd_mrv2.errors import AfdError, PipelineAborted, PipelineError, PluginError
from afd_mrv2.hookspecs import (
    HOOK_API_VERSION,
    OLDEST_SERVED_HOOK_API,
    ComputeFn,
    hookimpl,
    hookspec,
)
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import HOOK_NAMES, AttentionContext, ConnectorContext, FfnContext, role_context
from afd_mrv2.work import BufferSlot, Work

#: The hook specifications, in lifecycle order (set-up, per item, tear-down).
HOOKS = HOOK_NAMES


# ---------------------------------------------------------------- capability: expert-replica failover


class FailoverRecord(Protocol):
    """What an Attention side's failovers did (torch_p2p: ``FailoverLog``), read by the owner's figures."""

    @property
    def count(self) -> int:
        """FFN ranks failed over so far."""
        ...

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data: FFN ranks lost (when, why), re-sends, rejoins."""
        ...


class AttentionFailover(Protocol):
    """The Attention side of a connector that routes around lost FFN ranks (``afd.expert_replicas`` >= 2).

    The owner drives it between steps, with no item in flight: :meth:`start_without` for an FFN rank
    lost before the first item, :meth:`take_back` for one that came back (a restarted process the
    owner installed in its link); the connector itself fails over an FFN rank lost mid-item.
    """

    @property
    def live(self) -> frozenset[int]:
        """The FFN ranks (indices) the connector routes to now."""
        ...

    @property
    def failovers(self) -> FailoverRecord:
        """What its failovers did."""
        ...

    def start_without(self, ffn: int) -> None:
        """FFN rank ``ffn`` was lost before the first item: route its experts to their other holders
        from the first item; raises when some expert has no other live holder."""
        ...

    def take_back(self, ffn: int) -> None:
        """FFN rank ``ffn`` is back: route its experts to it again."""
        ...


class FfnFailover(Protocol):
    """The FFN side of a connector that serves an Attention rank's re-sends after it lost another FFN rank."""

    @property
    def redispatched(self) -> int:
        """The re-sent items this side served."""
        ...


@runtime_checkable
class SupportsFailover(Protocol):
    """Capability: the connector serves expert-replica failover (torch_p2p does).

    Opt in by listing it among the connector class's bases and implementing both methods; the
    owner reaches the role's side with :func:`failover_of` / :func:`ffn_failover_of`.
    """

    #: the marker an opting-in class inherits
    supports_failover: ClassVar[Literal[True]] = True

    def attention_failover(self) -> AttentionFailover | None:
        """This connector's Attention side as it fails over, or None where it cannot (another role, or
        a side that routes no FFN rank around)."""
        ...

    def ffn_failover(self) -> FfnFailover | None:
        """This connector's FFN side as it serves re-sends, or None on the Attention role."""
        ...


def failover_of(connector: object) -> AttentionFailover | None:
    """The Attention-side failover of ``connector`` (see :class:`SupportsFailover`), or None: then the owner
    cannot route around a lost FFN rank, and a lost FFN rank fails the items routed to it."""
    if isinstance(connector, SupportsFailover) and connector.supports_failover is True:
        return connector.attention_failover()
    return None


def ffn_failover_of(connector: object) -> FfnFailover | None:
    """The FFN-side failover of ``connector`` (see :class:`SupportsFailover`), or None: no re-sends counted."""
    if isinstance(connector, SupportsFailover) and connector.supports_failover is True:
        return connector.ffn_failover()
    return None


# ---------------------------------------------------------------- capability: results in flight


@runtime_checkable
class InFlight(Protocol):
    """A result a connector hands a ``sink`` before it arrived: :meth:`wait` returns it."""

    #: when the result arrived (``time.perf_counter_ns``), set once :meth:`wait` returned
    delivered_ns: int

    def wait(self) -> Any:
        """Block until the result arrived and return it; raise what the transfer raised."""
        ...


@runtime_checkable
class InFlightSink(Protocol):
    """Capability: a ``sink`` (a context field) that takes a result still in flight (:class:`InFlight`).

    A connector whose receive completes after its ``on_send`` may hand such a sink the
    :class:`InFlight` and free its send stream for the next item; any other sink (a plain
    function, a third party's wrapper around the owner's sink) gets the result itself, waited
    for in ``on_send``.  Opt in by listing it among the sink class's bases.
    """

    #: the marker an opting-in class inherits
    accepts_in_flight: ClassVar[Literal[True]] = True

    def __call__(self, item: WorkItem, result: Any, /) -> None: ...


def supports_in_flight(sink: object) -> bool:
    """True when ``sink`` takes results in flight (see :class:`InFlightSink`)."""
    return isinstance(sink, InFlightSink) and sink.accepts_in_flight is True


__all__ = [
    "HOOKS",
    "HOOK_API_VERSION",
    "OLDEST_SERVED_HOOK_API",
    "AfdError",
    "AttentionContext",
    "AttentionFailover",
    "BufferSlot",
    "ComputeFn",
    "ConnectorContext",
    "DeviceBackend",
    "Event",
    "FailoverRecord",
    "FfnContext",
    "FfnFailover",
    "InFlight",
    "InFlightSink",
    "PipelineAborted",
    "PipelineError",
    "PluginError",
    "Stream",
    "SupportsFailover",
    "Work",
    "WorkItem",
    "failover_of",
    "ffn_failover_of",
    "hookimpl",
    "hookspec",
    "role_context",
    "supports_in_flight",
]
