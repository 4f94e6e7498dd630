"""Acceptance: both Ascend connectors run on the shared executor's streams, events and slots only.

Three independent checks: (1) at run time every stream and event of a rank was
created by the executor (counted at the backend, and torch's own Stream/Event
constructors are booby-trapped for the whole run); (2) the op log of the
recording backend names only the executor's streams; (3) the connector modules'
source calls no stream/event constructor, no stream switch and no synchronize.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from afd_mrv2.devices import HostBackend, RecordingBackend
from afd_mrv2.hooks.cam import camasync, camp2p
from afd_mrv2.hooks.cam import common as cam_common
from afd_mrv2.hooks.cam import ops as cam_ops
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.probe.cluster import ClusterSpec, ranks
from tests.hooks.cam.harness import assert_matches_reference, run


class Counting:
    """Mixin: count what the backend creates."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []
        self._inside = False

    def new_stream(self, name):
        if not self._inside:  # the CPU backends build current_stream() from new_stream()
            self.created.append(f"stream:{name}")
        return super().new_stream(name)

    def current_stream(self, name):
        self.created.append(f"current:{name}")
        self._inside = True
        try:
            return super().current_stream(name)
        finally:
            self._inside = False

    def new_event(self):
        self.created.append("event")
        return super().new_event()


class CountingRecording(Counting, RecordingBackend):
    pass


class CountingHost(Counting, HostBackend):
    pass


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
        assert len(events) == 3 * spec.depth, key  # the executor's event pool, nothing more
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


def test_connectors_use_the_executor_they_are_given() -> None:
    # one executor class for every connector: the connector modules never import or build another
    for module in (camp2p, camasync):
        assert "pipeline.executor" not in inspect.getsource(module)
    assert Executor.__module__ == "afd_mrv2.pipeline.executor"
