"""Shared test fakes: connectors, observers (plain hook implementations, no transport), counting backends.

The no-op connector is product code (``afd-mrv2 bench`` measures with it):
:class:`afd_mrv2.bench.noop.NoopConnector`.

``RecordingConnector`` makes each item's inputs from its identity, runs the owner's
``compute`` and keeps the outputs; it records every hook call, with the thread it
ran on, and can be told to sleep, fail or block in a given phase.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from afd_mrv2 import hookimpl
from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import HostBackend, RecordingBackend
from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline import Executor
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import plugins_for
from afd_mrv2.work import Work
from tests.dists import write_dist_info


def item_inputs(item: WorkItem, rows: int = 8, width: int = 32) -> torch.Tensor:
    base = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width) / (rows * width)
    return base + item.layer_idx + 0.1 * item.stage_idx + 0.01 * item.seq


def matmul_compute(width: int = 32, reps: int = 2) -> Callable[[WorkItem, torch.Tensor], torch.Tensor]:
    weight = torch.randn(width, width, generator=torch.Generator().manual_seed(7)) / width**0.5

    def compute(item: WorkItem, x: torch.Tensor) -> torch.Tensor:
        for _ in range(reps):
            x = torch.tanh(x @ weight)
        return x

    return compute


@dataclass
class Call:
    phase: str
    item: WorkItem
    slots: tuple[int, int]  # (input slot, output slot)
    thread: str


@dataclass
class RecordingConnector:
    hook_api_version: ClassVar[int] = 1
    sleep_s: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    fail: tuple[str, int] | None = None  # (phase, seq) that raises
    block: tuple[str, int] | None = None  # (phase, seq) that blocks forever (ignores cancellation)
    block_cooperative: tuple[str, int] | None = None  # blocks until work.cancelled
    calls: list[Call] = field(default_factory=list)
    outputs: dict[WorkItem, torch.Tensor] = field(default_factory=dict)
    cleanups: list[tuple[WorkItem, BaseException]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    never: threading.Event = field(default_factory=threading.Event)

    def _enter(self, phase: str, work: Work) -> None:
        with self._lock:
            self.calls.append(
                Call(phase, work.item, (work.inputs.index, work.outputs.index), threading.current_thread().name)
            )
        if self.fail == (phase, work.item.seq):
            raise RuntimeError(f"planted failure in {phase}")
        if self.block == (phase, work.item.seq):
            self.never.wait()
        if self.block_cooperative == (phase, work.item.seq):
            while not work.cancelled:
                time.sleep(0.005)
            work.raise_if_cancelled()
        if self.sleep_s.get(phase):
            time.sleep(self.sleep_s[phase])

    @hookimpl
    def on_recv(self, work: Work) -> None:
        self._enter("recv", work)
        work.inputs.state = item_inputs(work.item)

    @hookimpl
    def on_compute(self, work: Work, compute: Callable) -> None:
        self._enter("compute", work)
        work.outputs.state = compute(work.item, work.inputs.state)

    @hookimpl
    def on_send(self, work: Work) -> None:
        self._enter("send", work)
        self.outputs[work.item] = work.outputs.state

    @hookimpl
    def on_cleanup(self, work: Work, error: BaseException) -> None:
        self.cleanups.append((work.item, error))

    def sequence(self, item: WorkItem) -> list[tuple[str, tuple[int, int]]]:
        return [(c.phase, c.slots) for c in self.calls if c.item == item]

    def order(self, phase: str) -> list[WorkItem]:
        return [c.item for c in self.calls if c.phase == phase]


@dataclass
class PhaseObserver:
    """Wraps every phase; records (phase, item, raised?) after the connector ran."""

    hook_api_version: ClassVar[int] = 1

    seen: list[tuple[str, WorkItem, bool]] = field(default_factory=list)

    def _wrap(self, phase: str, work: Work):  # type: ignore[no-untyped-def]
        try:
            result = yield
        except BaseException:
            self.seen.append((phase, work.item, True))
            raise
        self.seen.append((phase, work.item, False))
        return result

    @hookimpl(wrapper=True)
    def on_recv(self, work: Work):  # type: ignore[no-untyped-def]
        return (yield from self._wrap("recv", work))

    @hookimpl(wrapper=True)
    def on_compute(self, work: Work):  # type: ignore[no-untyped-def]
        return (yield from self._wrap("compute", work))

    @hookimpl(wrapper=True)
    def on_send(self, work: Work):  # type: ignore[no-untyped-def]
        return (yield from self._wrap("send", work))


def run_pipelined_on_threads(connector: object, items: list[WorkItem], *, depth: int, trace: Trace) -> None:
    """Run ``items`` through ``connector``, pipelined on the host backend (identity compute), into ``trace``."""
    config = MultistreamConfig(enabled=True, depth=depth)
    with Executor(plugins_for(connector), HostBackend(), config, compute=lambda i, x: x, trace=trace) as executor:
        executor.run(items)


def grid(layers: int, stages: int, per_stage: int) -> list[WorkItem]:
    """layers x stages x per_stage work items with increasing seq."""
    items = []
    for _ in range(per_stage):
        for layer in range(layers):
            for stage in range(stages):
                items.append(WorkItem(layer, stage, len(items)))
    return items


class Counting:
    """Backend mixin: ``created`` lists every stream and event the backend made, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []
        self._inside = False

    def new_stream(self, name):  # type: ignore[no-untyped-def]
        if not self._inside:  # the CPU backends build current_stream() from new_stream()
            self.created.append(f"stream:{name}")
        return super().new_stream(name)  # type: ignore[misc]

    def current_stream(self, name):  # type: ignore[no-untyped-def]
        self.created.append(f"current:{name}")
        self._inside = True
        try:
            return super().current_stream(name)  # type: ignore[misc]
        finally:
            self._inside = False

    def new_event(self):  # type: ignore[no-untyped-def]
        self.created.append("event")
        return super().new_event()  # type: ignore[misc]


class CountingRecording(Counting, RecordingBackend):
    pass


class CountingHost(Counting, HostBackend):
    pass


def install_entry_point(site: Path, monkeypatch: pytest.MonkeyPatch, dist: str, name: str, target: str) -> None:
    """Install ``name = target`` in the ``afd_mrv2`` entry-point group as a third party would: a
    ``<dist>-0.1.dist-info`` in ``site``, which goes on ``sys.path`` for the test."""
    write_dist_info(site, dist, "0.1", {"afd_mrv2": {name: target}})
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()


#: Frozen third-party plugin distributions (source trees with a pyproject.toml), one per hook API version.
THIRD_PARTY = Path(__file__).with_name("thirdparty")


def install_distribution(name: str, site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Install the frozen distribution ``tests/thirdparty/<name>`` into ``site`` as pip lays one out (its
    modules, and a dist-info with the entry points its pyproject.toml declares); ``site`` goes on
    ``sys.path`` (and, for child processes, ``PYTHONPATH``).  Returns ``site``."""
    source = THIRD_PARTY / name
    text = (source / "pyproject.toml").read_text()
    project = re.search(r'^name = "([^"]+)"\nversion = "([^"]+)"', text, re.M)
    section = re.search(r"^\[project\.entry-points\.afd_mrv2\]\n((?:[^\n\[]+\n)+)", text, re.M)
    assert project and section, f"{source}/pyproject.toml: expected name, version and afd_mrv2 entry points"
    dist, version = project.group(1), project.group(2)
    for module in source.glob("*.py"):
        shutil.copy(module, site / module.name)
        # a fresh import from this site, and none left behind: pop what an earlier test imported, then let
        # monkeypatch remember the name as absent so that its undo removes what this test imports
        sys.modules.pop(module.stem, None)
        monkeypatch.setitem(sys.modules, module.stem, None)  # type: ignore[arg-type]
        del sys.modules[module.stem]
    points = dict(line.replace('"', "").split(" = ", 1) for line in section.group(1).splitlines())
    write_dist_info(site, dist, version, {"afd_mrv2": points})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    importlib.invalidate_caches()
    return site
