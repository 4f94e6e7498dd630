"""Typed operator access for the CAM connectors, and the one narrow stream fence.

:func:`resolve_torch_ops`, :class:`OpSet`, :class:`BoundOp`, :class:`OpCapability`.

See docs/internals/cam-connectors.md, "afd_mrv2.hooks.cam.ops".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from afd_mrv2.devices.base import Stream
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.hooks.cam.evidence import Evidence, StreamBehaviour
from afd_mrv2.hooks.cam.stage_tags import StageTags


@dataclass(frozen=True)
class OpCapability:
    """What is known about one operator, and how (``basis``)."""

    qualname: str
    present: bool
    stream: StreamBehaviour
    basis: str
    home: str | None = None


class HomeStream(Protocol):
    """The stream a FOREIGN operator really runs on, as the fence sees it."""

    name: str

    def wait_for_caller(self, caller: Stream) -> None:
        """Make the home stream's next work wait for the caller's work issued so far."""
        ...

    def make_caller_wait(self, caller: Stream) -> None:
        """Make the caller's next work wait for the home stream's work issued so far."""
        ...


class DeviceHomeStream:
    """A home that is a ``torch.Stream`` (the device default stream, per the evidence)."""

    def __init__(self, native: torch.Stream, name: str = "default") -> None:
        self.native = native
        self.name = name

    def _caller(self, caller: Stream) -> torch.Stream:
        if caller.native is None:
            raise PluginError(
                f"the fence against home stream {self.name!r} needs an accelerator stream, got {caller.name!r}"
            )
        native: torch.Stream = caller.native
        return native

    def wait_for_caller(self, caller: Stream) -> None:
        self.native.wait_stream(self._caller(caller))

    def make_caller_wait(self, caller: Stream) -> None:
        self._caller(caller).wait_stream(self.native)


def default_home_stream() -> DeviceHomeStream:
    """The accelerator's default stream (where a stream-ignoring operator usually lands)."""
    device = torch.accelerator.current_accelerator()
    if device is None:
        raise PluginError("a foreign operator's home is the device default stream, but no accelerator is available")
    return DeviceHomeStream(torch.get_device_module(device).default_stream(), "default")


class BoundOp:
    """One resolved operator; calling it runs the operator, fenced only if FOREIGN.

    ``op(stream, *args)``: ``stream`` is the executor's stream the hook runs on.
    ``calls`` / ``fenced_calls`` count invocations (tests assert the fence ran).
    """

    def __init__(self, capability: OpCapability, fn: Callable[..., Any], home: HomeStream | None = None) -> None:
        if capability.stream is StreamBehaviour.FOREIGN and home is None:
            raise PluginError(
                f"{capability.qualname} runs off the caller's stream but no home stream is known to fence it"
            )
        self.capability = capability
        self.fn = fn
        self.home = home if capability.stream is StreamBehaviour.FOREIGN else None
        self._lock = threading.Lock()
        self.calls = 0
        self.fenced_calls = 0

    @property
    def qualname(self) -> str:
        return self.capability.qualname

    def __call__(self, stream: Stream, *args: Any) -> Any:
        with self._lock:
            self.calls += 1
        if self.home is None:
            return self.fn(*args)
        self.home.wait_for_caller(stream)
        out = self.fn(*args)
        self.home.make_caller_wait(stream)
        with self._lock:
            self.fenced_calls += 1
        return out


@dataclass(frozen=True)
class OpSet:
    """The operators one connector uses, resolved once.  ``source`` says from where.

    ``stage_tags``: the side channel the stage identity of their transfers
    travels on, when the operators' provider has one (the test doubles carry it
    in their payload metadata; :mod:`afd_mrv2.hooks.cam.stage_tags`).  The real
    operators' wire format has no room for it: None.
    """

    source: str
    ops: Mapping[str, BoundOp]
    stage_tags: StageTags | None = None

    def __getitem__(self, name: str) -> BoundOp:
        return self.ops[name]

    @property
    def capabilities(self) -> list[OpCapability]:
        return [op.capability for op in self.ops.values()]

    def check_start_up(self, recv: Iterable[str], send: Iterable[str], *, connector: str, pipelined: bool) -> None:
        """Refuse what cannot run safely, before any communication.

        ``recv`` / ``send``: the operators this role calls in its recv and send
        phases.  Refused: a missing operator; multistream with an operator whose
        stream behaviour is unverified; multistream when a recv-phase and a
        send-phase operator are both FOREIGN on the same home stream (that home
        runs them one after the other anyway, so there is no overlap to gain, and
        a blocking receive queued on it ahead of the send it waits for deadlocks
        when the phases reach the home in another order than issued).
        """
        recv_ops, send_ops = [self.ops[n] for n in recv], [self.ops[n] for n in send]
        needed = recv_ops + send_ops
        missing = [op.qualname for op in needed if not op.capability.present]
        if missing:
            raise PluginError(f"connector {connector!r}: operators not available: {', '.join(missing)}")
        if not pipelined:
            return
        unverified = [op.qualname for op in needed if op.capability.stream is StreamBehaviour.UNVERIFIED]
        if unverified:
            raise ConfigError(
                "afd.multistream.enabled",
                f"connector {connector!r} cannot run multistream: the current-stream behaviour of "
                f"{', '.join(unverified)} is unverified; run `afd-mrv2 probe npu` on the target machine and pass "
                "its file as afd.connector_extra_config.stream_evidence, or keep multistream disabled",
            )
        homes = {op.home.name: op.qualname for op in recv_ops if op.home is not None}
        clash = [(homes[op.home.name], op.qualname) for op in send_ops if op.home is not None and op.home.name in homes]
        if clash:
            a, b = clash[0]
            raise ConfigError(
                "afd.multistream.enabled",
                f"connector {connector!r}: {a} (recv phase) and {b} (send phase) both ignore the caller's stream and "
                f"share one home stream, which serializes them: multistream gains nothing and can deadlock; "
                "keep multistream disabled for this role (the fence keeps serialized execution correct)",
            )


def resolve_torch_ops(namespace: str, names: Iterable[str]) -> dict[str, Callable[..., Any] | None]:
    """``name -> torch.ops.<namespace>.<name>`` or None where the dispatcher has no schema."""
    found: dict[str, Callable[..., Any] | None] = {}
    for name in names:
        try:
            torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "")
        except RuntimeError:
            found[name] = None
            continue
        found[name] = getattr(getattr(torch.ops, namespace), name)
    return found


def torch_opset(
    namespace: str,
    known: Mapping[str, tuple[StreamBehaviour, str]],
    *,
    evidence: Evidence | None,
    environment: Mapping[str, str],
    install_hint: str,
) -> OpSet:
    """Resolve ``known``'s operators from ``torch.ops.<namespace>``; missing ones raise.

    ``known`` gives each operator's stream behaviour as established without a
    probe (and its basis).  Evidence, when it applies to ``environment``, replaces
    it; evidence written for another software stack is ignored (named in basis).
    """
    resolved = resolve_torch_ops(namespace, known)
    found = {n: fn for n, fn in resolved.items() if fn is not None}
    missing = [f"{namespace}.{n}" for n in resolved if n not in found]
    if missing:
        raise PluginError(f"operators not registered with torch: {', '.join(missing)}; {install_hint}")
    ops = {}
    applies = evidence is not None and evidence.applies_to(environment)
    for name, fn in found.items():
        qualname = f"{namespace}.{name}"
        stream, basis = known[name]
        home = None
        if evidence is not None and (entry := evidence.get(qualname)) is not None:
            if applies:
                stream, home, basis = entry.stream, entry.home, f"probe evidence: {entry.detail or stream.value}"
            else:
                basis = f"{basis} (evidence ignored: written for {dict(evidence.environment)})"
        capability = OpCapability(qualname, True, stream, basis, home)
        ops[name] = BoundOp(capability, fn, default_home_stream() if stream is StreamBehaviour.FOREIGN else None)
    return OpSet(f"torch.ops.{namespace}", ops)


def load_evidence(extra: Mapping[str, Any], key: str) -> Evidence | None:
    """The evidence named by ``connector_extra_config.stream_evidence`` (a path), if any."""
    path = extra.get("stream_evidence")
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(key, f"expected a path to an afd-mrv2 probe evidence file, got {path!r}")
    return Evidence.load(path, key=key)


#: Distributions whose versions an evidence file is tied to (the probe records them,
#: the connectors compare them): the NPU runtime and both CAM operator libraries.
EVIDENCE_DISTRIBUTIONS = ("torch_npu", "umdk_cam_op_lib", "afd-plugin")


def installed_versions(*distributions: str) -> dict[str, str]:
    """Versions of torch and of the named distributions that are installed."""
    from importlib import metadata

    versions: dict[str, str] = {"torch": torch.__version__}
    for name in distributions or EVIDENCE_DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


@dataclass(frozen=True)
class OperatorFamily:
    """One CAM connector's operators: its entry-point name, its ``torch.ops`` namespace,
    the operator names, and what is known of each operator's stream behaviour
    (behaviour, basis) before any probe ran."""

    name: str
    namespace: str
    ops: tuple[str, ...]
    known: Mapping[str, tuple[StreamBehaviour, str]]
