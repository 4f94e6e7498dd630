"""The probe's escape check (``afd_mrv2.probe.npu._escape``) classifies on CPU, against a controllable fake.

Two threads play the two NPU ranks.  Each has a fake stream that ``hold()``
keeps busy for a window; the fake operator pair either runs in stream order
(its effect waits for the caller's held stream) or escapes it (its effect
happens at once).  The real ``_escape`` runs unchanged and must say ``current``,
``foreign`` or, when the window is gone before anything could be told,
``unverified``.  The device-only parts (matmul chains, side streams, HCCL) are
what the fake replaces; the classification logic is the product's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from afd_mrv2.probe.npu import _escape

WINDOW_S = 0.3
PAYLOAD = torch.ones(4)


class _Wire:
    """One message between the ranks: when its data reaches the receiver."""

    def __init__(self) -> None:
        self.delivered_at: float | None = None


class _Received:
    """A receive's output: final once the data arrived and (unless it escapes) the caller's stream passed it."""

    def __init__(self, wire: _Wire, stream_free_at: float) -> None:
        self.wire, self.stream_free_at = wire, stream_free_at

    def complete(self) -> bool:
        now = time.monotonic()
        return self.wire.delivered_at is not None and now >= max(self.wire.delivered_at, self.stream_free_at)

    def now(self) -> torch.Tensor:
        return PAYLOAD.clone() if self.complete() else torch.zeros_like(PAYLOAD)

    def cpu(self) -> torch.Tensor:
        return self.now()


class _Event:
    def __init__(self, rank: _FakeRank) -> None:
        self.rank = rank
        self.last: _Received | None = None

    def record(self) -> None:
        self.last = self.rank.last_recv

    def query(self) -> bool:
        return self.last is None or self.last.complete()


class _Npu:
    def __init__(self, rank: _FakeRank) -> None:
        self.rank = rank

    def synchronize(self) -> None:
        while self.rank.busy() or (self.rank.last_recv is not None and not self.rank.last_recv.complete()):
            time.sleep(0.005)

    def Event(self) -> _Event:  # mirrors torch.npu.Event
        return _Event(self.rank)


class _World:
    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots: list[Any] = [None, None]
        self.wires = [_Wire(), _Wire()]  # the escape check sends one message each way round


class _FakeRank:
    """What ``_escape`` uses of ``_Rank``: a holdable stream, side reads, barrier and gather."""

    def __init__(self, rank: int, world: _World, window_s: float) -> None:
        self.rank, self.world, self.window_s = rank, world, window_s
        self.npu = _Npu(self)
        self.busy_until = 0.0
        self.last_recv: _Received | None = None

    def hold(self) -> None:
        self.busy_until = time.monotonic() + self.window_s

    def busy(self) -> bool:
        return time.monotonic() < self.busy_until

    def side_read(self, out: _Received) -> torch.Tensor:
        return out.now()

    def barrier(self) -> None:
        self.world.barrier.wait()

    def gather(self, value: Any) -> list[Any]:
        self.world.slots[self.rank] = value
        self.barrier()
        out = list(self.world.slots)
        self.barrier()
        return out

    # the operator pair; ``escapes`` names the ones that ignore the caller's stream
    def operators(self, escapes: set[str]) -> tuple[Any, Any]:
        sent, received = iter(self.world.wires), iter(self.world.wires)  # messages pair up in order

        def send() -> None:
            now = time.monotonic()
            next(sent).delivered_at = now if "send" in escapes else max(now, self.busy_until)

        def recv() -> _Received:
            self.last_recv = _Received(next(received), 0.0 if "recv" in escapes else self.busy_until)
            return self.last_recv

        return send, recv


def run_escape(escapes: set[str], window_s: float = WINDOW_S) -> dict[str, tuple[str, str]]:
    """Both ranks run the real ``_escape`` (rank 0 sends); the measurements of both, merged."""
    world = _World()
    found: dict[str, tuple[str, str]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        me = _FakeRank(r, world, window_s)
        send, recv = me.operators(escapes)
        try:
            found.update(_escape(me, 0, send, recv))  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    return found


def kinds(found: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {direction: kind for direction, (kind, _detail) in found.items()}


def test_operators_in_stream_order_are_current() -> None:
    assert kinds(run_escape(set())) == {"recv": "current", "send": "current"}


@pytest.mark.parametrize(
    ("escapes", "expected"),
    [
        ({"recv"}, {"recv": "foreign", "send": "current"}),
        ({"send"}, {"recv": "current", "send": "foreign"}),
        ({"send", "recv"}, {"recv": "foreign", "send": "foreign"}),
    ],
)
def test_an_operator_that_escapes_the_held_stream_is_foreign(escapes: set[str], expected: dict[str, str]) -> None:
    assert kinds(run_escape(escapes)) == expected


def test_a_window_gone_before_the_first_read_is_unverified() -> None:
    found = run_escape({"send", "recv"}, window_s=0.0)
    assert kinds(found) == {"recv": "unverified", "send": "unverified"}
    assert all("raise --window-ms" in detail for _kind, detail in found.values())
