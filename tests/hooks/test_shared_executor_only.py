"""Acceptance: the connectors run on the shared executor's streams, events and slots only.

Four independent checks: (1) at run time every stream and event of a rank was
created by the executor (counted at the backend, and torch's own Stream/Event
constructors are booby-trapped for the whole run); (2) the op log of the
recording backend names only the executor's streams; (3) the connector modules'
source calls no stream/event constructor, no stream switch and no synchronize; and
(4) every phase call of every item of the built-in in-process connectors (camp2p,
camasync, simlink) runs inside the op the given executor submitted for it, on the
given backend, witnessed by an observer.  torch_p2p needs one process per rank (a
torch.distributed group) and is not witnessed here.
"""

from __future__ import annotations

import ast
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from afd_mrv2 import hookimpl
from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.devices import RecordingBackend
from afd_mrv2.devices.recording import Op
from afd_mrv2.hooks.cam import camasync, camp2p
from afd_mrv2.hooks.cam import common as cam_common
from afd_mrv2.hooks.cam import ops as cam_ops
from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.plugins import ConnectorContext, FfnContext, load_plugins
from afd_mrv2.probe.cluster import ClusterSpec, ranks
from afd_mrv2.stages import attention_items
from afd_mrv2.work import Work
from tests.connectors import CountingHost, CountingRecording, install_entry_point
from tests.hooks.cam.harness import MODEL, assert_matches_reference, run


@pytest.fixture
def no_torch_streams(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def trap(name: str):
        def constructor(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} constructed during a connector run")

        return constructor

    for name in ("Stream", "Event"):
        monkeypatch.setattr(torch, name, trap(f"torch.{name}"))
    for name in ("Stream", "Event", "default_stream", "current_stream", "set_stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, trap(f"torch.cuda.{name}"))
    monkeypatch.setattr(torch.accelerator, "synchronize", trap("torch.accelerator.synchronize"))
    return calls


@pytest.mark.parametrize("backend", [CountingRecording, CountingHost], ids=["recording", "host"])
@pytest.mark.parametrize("multistream", [False, True], ids=["serialized", "multistream"])
@pytest.mark.parametrize("connector", ["camp2p", "camasync"])
def test_every_stream_and_event_comes_from_the_executor(
    connector: str, multistream: bool, backend: type, no_torch_streams: list[str]
) -> None:
    torch.set_num_threads(1)
    spec = ClusterSpec(
        connector,
        num_attention=2,
        num_ffn=2,
        batches=((5, 3), (4,)),
        multistream=multistream,
        backend="recording" if backend is CountingRecording else "host",
    )
    backends = {key: backend() for key in ranks(spec)}
    result = run(spec, backends=backends)
    assert_matches_reference(result.outputs(), spec)
    assert no_torch_streams == []
    for key, b in backends.items():
        events = [c for c in b.created if c == "event"]
        streams = sorted(c for c in b.created if c != "event")
        counts = spec.config(key[0]).multistream.buffer_counts
        assert len(events) == 3 * sum(counts), key  # the executor's event pool, nothing more
        expected = ["current:compute", "stream:recv", "stream:send"] if multistream else ["current:serial"]
        assert streams == expected, key
        if isinstance(b, RecordingBackend):
            assert {op.stream for op in b.log if op.stream} == {s.split(":")[1] for s in expected}
    for connector_obj in result.connectors():
        assert not hasattr(connector_obj, "streams") and not hasattr(connector_obj, "events")


FORBIDDEN_CALLS = {
    "Stream",
    "Event",
    "new_stream",
    "new_event",
    "current_stream",
    "set_stream",
    "synchronize",
    "default_stream",
    "stream",
    "record",
    "wait",
    "wait_event",
    "record_event",
}


@pytest.mark.parametrize("module", [camp2p, camasync, cam_common], ids=lambda m: m.__name__)
def test_connector_sources_touch_no_streams(module) -> None:
    tree = ast.parse(inspect.getsource(module))
    called = {
        node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    assert not called & FORBIDDEN_CALLS, called & FORBIDDEN_CALLS
    assert "Executor" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def test_the_fence_only_orders_existing_streams() -> None:
    """cam_ops may order streams (wait_stream) but never creates one or synchronizes the device."""
    tree = ast.parse(inspect.getsource(cam_ops))
    called = {
        node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert "wait_stream" in called
    assert not called & {"Stream", "Event", "new_stream", "new_event", "synchronize", "record", "record_event"}


# ------------------------------------------------------------ every phase goes through the executor
#
# A witness observer (the entry point of a faked installed distribution, loaded through
# the ``observers`` config key like any third party's) wraps every phase hook.  Each
# rank runs on its own recording backend, which runs a submitted op inline: so at each
# phase call the witness sees which op of that rank's backend is running, on which stream.


@dataclass
class Rank:
    backend: RecordingBackend
    seen: list[Witnessed] = field(default_factory=list)


@dataclass(frozen=True)
class Witnessed:
    phase: str
    item: WorkItem
    stream: object  # the stream the executor passed to the hook
    running: object  # the stream the backend was running an op on at that moment
    op: Op | None  # the backend's latest op at that moment


WITNESSED: dict[tuple[str, int], Rank] = {}  # (role, rank) -> that rank's backend and phase calls


class PhaseWitness:
    hook_api_version = 2

    def __init__(self, context: ConnectorContext) -> None:
        context = context.typed()
        self.rank = WITNESSED[(context.role, context.role_rank or 0)]

    def _wrap(self, phase: str, work, stream):  # type: ignore[no-untyped-def]
        backend = self.rank.backend
        latest = backend.log[-1] if backend.log else None
        self.rank.seen.append(Witnessed(phase, work.item, stream, backend.current, latest))
        return (yield)

    @hookimpl(wrapper=True)
    def on_recv(self, work, stream):  # type: ignore[no-untyped-def]
        return (yield from self._wrap("recv", work, stream))

    @hookimpl(wrapper=True)
    def on_compute(self, work, stream):  # type: ignore[no-untyped-def]
        return (yield from self._wrap("compute", work, stream))

    @hookimpl(wrapper=True)
    def on_send(self, work, stream):  # type: ignore[no-untyped-def]
        return (yield from self._wrap("send", work, stream))


@pytest.fixture
def witnessed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[str, int], Rank]]:
    install_entry_point(tmp_path, monkeypatch, "afd_witness", "witness", f"{__name__}:PhaseWitness")
    yield WITNESSED
    WITNESSED.clear()


def assert_every_phase_went_through_the_executor(rank: Rank, multistream: bool) -> int:
    """Each phase call ran inside the op its executor submitted for it, on the phase's stream; returns #items."""
    submits = [op for op in rank.backend.log if op.kind == "submit"]
    assert len(rank.seen) == len(submits) > 0  # one phase call per submitted op, none outside
    for seen, op in zip(rank.seen, submits, strict=True):
        assert seen.op is op and (seen.phase, seen.item) == (op.name, op.item)
        assert seen.stream is seen.running  # the hook got the stream its op runs on
        assert op.stream == (seen.phase if multistream else "serial")
    phases: dict[WorkItem, list[str]] = {}
    for seen in rank.seen:
        phases.setdefault(seen.item, []).append(seen.phase)
    assert all(p == ["recv", "compute", "send"] for p in phases.values()), phases
    return len(phases)


@dataclass(frozen=True)
class WitnessedSpec(ClusterSpec):
    def config(self, role: str) -> AfdConfig:
        return replace(super().config(role), observers=("witness",))


@pytest.mark.parametrize("multistream", [False, True], ids=["serialized", "multistream"])
@pytest.mark.parametrize("connector", ["camp2p", "camasync"])
def test_connectors_use_the_executor_they_are_given(
    connector: str, multistream: bool, witnessed: dict[tuple[str, int], Rank]
) -> None:
    torch.set_num_threads(1)
    spec = WitnessedSpec(connector, num_attention=2, num_ffn=2, batches=((5, 3), (4, 2)), multistream=multistream)
    witnessed.update({key: Rank(RecordingBackend()) for key in ranks(spec)})
    result = run(spec, backends={key: rank.backend for key, rank in witnessed.items()})
    assert_matches_reference(result.outputs(), spec)
    layers = MODEL.spec.num_layers
    for (role, _), rank in witnessed.items():
        items = assert_every_phase_went_through_the_executor(rank, multistream)
        if role == "attention":
            assert items == len(list(attention_items(layers, spec.num_stages)))
        else:
            assert items >= layers * spec.num_stages


@pytest.mark.parametrize("multistream", [False, True], ids=["serialized", "multistream"])
def test_simlink_uses_the_executor_it_is_given(multistream: bool, witnessed: dict[tuple[str, int], Rank]) -> None:
    outputs: dict[WorkItem, torch.Tensor] = {}
    config = parse_afd_config(
        {
            "connector": "simlink",
            "role": "ffn",
            "observers": ["witness"],
            "multistream": {"enabled": multistream, "depth": 2, "backend": "recording"},
        }
    )
    rank = witnessed.setdefault(("ffn", 0), Rank(RecordingBackend()))
    context = FfnContext(
        config=config, source=lambda item: torch.full((2, 4), float(item.seq)), sink=outputs.__setitem__
    )
    items = [WorkItem(i % 2, (i // 2) % 2, i) for i in range(10)]
    with Executor(load_plugins(context), rank.backend, config.multistream, compute=lambda i, x: x + 1) as ex:
        ex.run(items)
    assert assert_every_phase_went_through_the_executor(rank, multistream) == len(items)
    assert {item: float(out[0, 0]) for item, out in outputs.items()} == {item: item.seq + 1.0 for item in items}


def test_the_witness_sees_a_phase_called_outside_the_executor(witnessed: dict[tuple[str, int], Rank]) -> None:
    config = parse_afd_config({"connector": "simlink", "role": "ffn", "observers": ["witness"]})
    rank = witnessed.setdefault(("ffn", 0), Rank(RecordingBackend()))
    plugins = load_plugins(FfnContext(config=config, source=lambda item: torch.zeros(1), sink=lambda item, out: None))
    with Executor(plugins, rank.backend, config.multistream, compute=lambda i, x: x) as ex:
        ex.run([WorkItem(0, 0, 0)])
        stray = Work(WorkItem(0, 0, 1), ex.inputs[0], ex.outputs[0], threading.Event())
        plugins.hook.on_recv(work=stray, stream=ex.streams["recv"])  # a phase run beside the executor
    with pytest.raises(AssertionError):
        assert_every_phase_went_through_the_executor(rank, multistream=False)
