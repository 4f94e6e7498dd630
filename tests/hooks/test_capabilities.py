"""Declared capabilities (``afd_mrv2.api``): a plugin opts in by its bases, the owner asks with a check
function, and nothing in the connectors or the vLLM integration probes a connector's attributes."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from afd_mrv2.api import (
    AttentionContext,
    FfnContext,
    InFlightSink,
    SupportsFailover,
    Work,
    WorkItem,
    failover_of,
    ffn_failover_of,
    hookimpl,
    supports_in_flight,
)
from afd_mrv2.config import parse_afd_config
from afd_mrv2.hooks.p2p import P2pShape, PeerLink
from afd_mrv2.hooks.p2p.roundtrip import RoundTripAttentionSide
from afd_mrv2.hooks.p2p.torch_p2p import TorchP2pConnector
from afd_mrv2.mrv2.attention.exchange import UBatchExchange
from afd_mrv2.plugins import load_plugins, plugins_for
from afd_mrv2.topology import Topology

ROOT = Path(__file__).resolve().parents[2]


class _Log:
    count = 0

    def as_dict(self) -> dict[str, Any]:
        return {"failovers": self.count}


class _ReplicaSide:
    """A third party's Attention side that routes around lost FFN ranks (plain attributes, no base)."""

    def __init__(self) -> None:
        self.live = frozenset({0, 1})
        self.failovers = _Log()

    def start_without(self, ffn: int) -> None:
        self.live -= {ffn}

    def take_back(self, ffn: int) -> None:
        self.live |= {ffn}


class _Phases:
    @hookimpl
    def on_recv(self, work: Work) -> None: ...

    @hookimpl
    def on_compute(self, work: Work, compute: Any) -> None: ...

    @hookimpl
    def on_send(self, work: Work) -> None: ...


class ReplicaLink(_Phases, SupportsFailover):
    """A third-party connector that opts in to failover by listing the capability among its bases."""

    hook_api_version = 2

    def __init__(self) -> None:
        self.side = _ReplicaSide()

    def attention_failover(self) -> _ReplicaSide:
        return self.side

    def ffn_failover(self) -> None:
        return None


class LookAlikeLink(_Phases):
    """The same methods, undeclared: a connector is not taken to fail over because of what it happens to have."""

    hook_api_version = 2
    side = _ReplicaSide()

    def attention_failover(self) -> _ReplicaSide:
        return self.side

    def ffn_failover(self) -> None:
        return None


def test_a_third_party_connector_opts_in_to_failover_and_the_owner_reaches_its_side() -> None:
    plugins = plugins_for(ReplicaLink(), name="replica_link")
    failover = failover_of(plugins.connector)
    assert failover is plugins.connector.side
    failover.start_without(1)
    assert failover.live == {0}
    failover.take_back(1)
    assert failover.live == {0, 1} and failover.failovers.count == 0
    assert ffn_failover_of(plugins.connector) is None
    assert ReplicaLink.supports_failover is True  # the marker the base sets


@pytest.mark.parametrize("connector", [LookAlikeLink(), object(), None])
def test_a_connector_that_does_not_opt_in_has_no_failover(connector: object) -> None:
    assert failover_of(connector) is None
    assert ffn_failover_of(connector) is None


def test_a_built_in_connector_without_failover_is_treated_as_not_supporting_it() -> None:
    config = parse_afd_config({"connector": "simlink", "role": "attention"})
    plugins = load_plugins(AttentionContext(config=config, source=lambda item: None, sink=lambda item, out: None))
    assert not isinstance(plugins.connector, SupportsFailover)
    assert failover_of(plugins.connector) is None and ffn_failover_of(plugins.connector) is None


class _Pending:
    def __init__(self) -> None:
        self._done = threading.Event()

    def wait(self) -> None:
        self._done.wait()


class _Group:
    """A process group that never delivers: enough to build a link (its control receives stay posted)."""

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Pending:
        return _Pending()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Pending:
        return _Pending()


SHAPE = P2pShape(hidden_size=8, top_k=2, num_experts=4, num_layers=2, max_tokens=4)


def _torch_p2p(role: str, **objects: Any) -> TorchP2pConnector:
    topology = Topology(1, 2, 4, expert_replicas=2)
    config = parse_afd_config({"connector": "torch_p2p", "role": role, "num_attention_ranks": 1, "num_ffn_ranks": 2})
    link = PeerLink(topology, topology.global_rank(role, 0), _Group())
    cls = AttentionContext if role == "attention" else FfnContext
    return TorchP2pConnector(cls(config=config, p2p_link=link, model=SHAPE, **objects))


def test_torch_p2p_declares_failover_on_the_side_that_has_it() -> None:
    exchange = UBatchExchange()
    round_trip = _torch_p2p("attention", source=exchange.source, sink=exchange.sink)
    failover = failover_of(round_trip)
    assert isinstance(failover, RoundTripAttentionSide) and failover is round_trip.side
    assert failover.live == {0, 1} and failover.failovers.count == 0
    assert ffn_failover_of(round_trip) is None
    pipelined = _torch_p2p("attention")  # the owner drives the layer loop: nothing routes around a lost rank
    assert failover_of(pipelined) is None
    ffn = _torch_p2p("ffn")
    resends = ffn_failover_of(ffn)
    assert resends is ffn.side and resends.redispatched == 0
    assert failover_of(ffn) is None


class _OptedInSink(InFlightSink):
    def __call__(self, item: WorkItem, result: Any) -> None: ...


class _UndeclaredSink:
    accepts_in_flight = False

    def __call__(self, item: WorkItem, result: Any) -> None: ...


def test_a_sink_takes_results_in_flight_only_when_it_declares_it() -> None:
    exchange = UBatchExchange()
    assert supports_in_flight(exchange.sink)  # afd-mrv2's own sink opts in
    assert supports_in_flight(_OptedInSink())
    wrapped = lambda item, result: exchange.sink(item, result)  # noqa: E731 - a third party's wrapper
    for sink in (wrapped, _UndeclaredSink(), print, None):
        assert not supports_in_flight(sink)
    # torch_p2p's round-trip side hands an in-flight combine only to the sink that declared it
    assert _torch_p2p("attention", source=exchange.source, sink=exchange.sink).side.sink_accepts_in_flight
    assert not _torch_p2p("attention", source=exchange.source, sink=wrapped).side.sink_accepts_in_flight


# ------------------------------------------------------------------ no probing comes back

#: Where a connector's objects are used: the connectors and the vLLM integration.
PROBE_ROOTS = ("afd_mrv2/hooks", "afd_mrv2/mrv2")

#: The calls that remain, each with why.  A listed call that is gone fails too: drop its entry.
ALLOWED_PROBES = {
    ("afd_mrv2/mrv2/deployment.py", "getattr(vllm_config, 'use_v2_model_runner', False)"): (
        "vLLM's config, not a connector: the field only some vLLM releases have (the upstream adapter's to type)"
    ),
    ("afd_mrv2/mrv2/deployment.py", "getattr(model_config, 'architectures', None)"): (
        "vLLM's model config, not a connector: only named in an error message"
    ),
}


def _probes() -> set[tuple[str, str]]:
    """``hasattr(...)``, ``getattr(obj, name, default)`` and ``getattr(obj, "literal")`` calls: asking an
    object whether it has something instead of declaring it (``getattr(obj, name)`` of a computed name,
    a forwarding module ``__getattr__`` or a header's fields, is not a probe)."""
    found = set()
    for root in PROBE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                name, args = node.func.id, node.args
                literal = len(args) == 2 and isinstance(args[1], ast.Constant)
                if name == "hasattr" or (name == "getattr" and (len(args) == 3 or literal)):
                    found.add((path.relative_to(ROOT).as_posix(), ast.unparse(node)))
    return found


def test_no_connector_object_is_probed_in_the_connectors_or_the_vllm_integration() -> None:
    probes = _probes()
    new = sorted(probes - set(ALLOWED_PROBES))
    assert new == [], (
        "getattr/hasattr probing came back; declare a capability in afd_mrv2.api (a Protocol a class opts into, "
        f"with its check function) instead: {new}"
    )
    assert sorted(set(ALLOWED_PROBES) - probes) == [], "a listed probe is gone: drop it from ALLOWED_PROBES"


def test_the_probe_finder_finds_a_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the walk above sees each kind of probe."""
    (tmp_path / "afd_mrv2" / "hooks").mkdir(parents=True)
    (tmp_path / "afd_mrv2" / "mrv2").mkdir()
    (tmp_path / "afd_mrv2" / "hooks" / "x.py").write_text(
        "a = getattr(c, 'side', None)\nb = hasattr(c, 'take_back')\nd = getattr(c, 'side')\ne = getattr(c, name)\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert {call for _, call in _probes()} == {
        "getattr(c, 'side', None)",
        "hasattr(c, 'take_back')",
        "getattr(c, 'side')",
    }
