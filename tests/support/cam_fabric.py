"""The transport under the CAM doubles, and the "own stream" of a stream-ignoring double.

:class:`Fabric` is a set of in-process mailboxes.  A message is posted by one
rank to another on a *channel* (an HCCL group, a CAM comm id) and taken by the
receiver with a predicate.  Delivery can be delayed per message
(``delay(message) -> seconds``): a delayed message becomes visible later, so a
message posted after it may be taken first (an *overtake*, counted).  Delays
keep FIFO order within a message's ``fifo`` domain (what the real transport
orders: one HCCL group between two ranks; one CAM source, destination and
layer), so doubles reorder only what the real operators may reorder.

:class:`ForeignWorker` is where a double that ignores the caller's stream does
its work: a thread that runs each effect after ``lag_s``.  The call returns at
once, so the effect completes *after* the caller's stream has moved on, which is
what an operator on another device stream looks like to the executor.  It is
also that operator's :class:`~afd_mrv2.hooks.cam.ops.HomeStream`: the fence's
"after" step drains it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from afd_mrv2.devices.base import Stream


@dataclass
class Message:
    seq: int
    channel: Hashable
    src: int
    dst: int
    tag: tuple
    payload: dict[str, Any]
    visible_at: float


class DelayEveryOther:
    """Delay every second message of each (channel kind, source, destination, tag).

    On the CAMAsync dispatch channel that is each layer's stage-1 transfer: the
    next layer's stage 0 then arrives first, which the FFN side must park.
    """

    def __init__(self, kind: str, seconds: float) -> None:
        self.kind, self.seconds = kind, seconds
        self._seen: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def __call__(self, message: Message) -> float:
        if not isinstance(message.channel, tuple) or message.channel[0] != self.kind:
            return 0.0
        key = (message.channel, message.src, message.dst, message.tag)
        with self._lock:
            count = self._seen[key] = self._seen.get(key, 0) + 1
        return self.seconds if count % 2 == 0 else 0.0


class DelayChannel:
    """Delay every message on the given channels (a CAMP2P stage's HCCL group: the other stage finishes first)."""

    def __init__(self, channels: tuple[Hashable, ...], seconds: float) -> None:
        self.channels, self.seconds = channels, seconds

    def __call__(self, message: Message) -> float:
        return self.seconds if message.channel in self.channels else 0.0


class FabricAborted(RuntimeError):
    """The fabric was aborted while a receive waited."""


class Fabric:
    """In-process mailboxes; see the module docstring."""

    def __init__(self, *, delay: Callable[[Message], float] | None = None, timeout_s: float = 30.0) -> None:
        self._delay = delay
        self._timeout_s = timeout_s
        self._messages: list[Message] = []
        self._last_visible: dict[Hashable, float] = {}
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._aborted = False
        self.posted = 0
        self.overtakes = 0  # taken while an earlier-posted message to the same rank was still pending
        self.late_deliveries = 0  # taken after a later-posted message to the same rank became visible

    def post(
        self, *, channel: Hashable, src: int, dst: int, tag: tuple, payload: dict[str, Any], fifo: Hashable
    ) -> None:
        with self._cond:
            message = Message(next(self._seq), channel, src, dst, tag, payload, 0.0)
            at = time.monotonic() + (self._delay(message) if self._delay else 0.0)
            message.visible_at = max(at, self._last_visible.get(fifo, 0.0))
            self._last_visible[fifo] = message.visible_at
            self._messages.append(message)
            self.posted += 1
            self._cond.notify_all()

    def take(self, *, channel: Hashable, dst: int, match: Callable[[Message], bool] = lambda m: True) -> Message:
        """Block until a visible message for ``dst`` on ``channel`` matches; remove and return it."""
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            while True:
                if self._aborted:
                    raise FabricAborted("fabric aborted while a receive was waiting")
                now = time.monotonic()
                candidates = [m for m in self._messages if m.channel == channel and m.dst == dst and match(m)]
                ready = [m for m in candidates if m.visible_at <= now]
                if ready:
                    message = min(ready, key=lambda m: (m.visible_at, m.seq))
                    self._messages.remove(message)
                    same = [m for m in self._messages if m.dst == dst]
                    self.overtakes += any(m.seq < message.seq for m in same)
                    self.late_deliveries += any(m.seq > message.seq and m.visible_at < message.visible_at for m in same)
                    return message
                if now >= deadline:
                    raise TimeoutError(f"fabric: nothing for rank {dst} on {channel!r} after {self._timeout_s:g} s")
                wake = min([m.visible_at for m in candidates] + [deadline]) - now
                self._cond.wait(max(wake, 1e-4))

    def peek(self, *, channel: Hashable, dst: int) -> bool:
        """True when a message for ``dst`` on ``channel`` has been posted (visible or not)."""
        with self._cond:
            return any(m.channel == channel and m.dst == dst for m in self._messages)

    def pending(self) -> int:
        with self._cond:
            return len(self._messages)

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class ForeignWorker:
    """The stream a stream-ignoring double really runs on; see the module docstring."""

    def __init__(self, name: str, lag_s: float) -> None:
        self.name = name
        self.lag_s = lag_s
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"cam-double-{name}", daemon=True)
        self._thread.start()

    def submit(self, effect: Callable[[], None]) -> None:
        with self._cond:
            self._submitted += 1
        self._queue.put(effect)

    def _loop(self) -> None:
        while True:
            effect = self._queue.get()
            if effect is None:
                return
            time.sleep(self.lag_s)
            try:
                effect()
            except BaseException as exc:  # noqa: BLE001 - surfaced by drain() on the caller's stream
                with self._cond:
                    self._error = self._error or exc
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every effect submitted so far ran; re-raise the first failure."""
        with self._cond:
            target = self._submitted
            if not self._cond.wait_for(lambda: self._done >= target, timeout_s):
                raise TimeoutError(f"{self.name}: operator work did not finish within {timeout_s:g} s")
            if self._error is not None:
                raise RuntimeError(f"{self.name}: operator failed on its own stream: {self._error}") from self._error

    # HomeStream protocol: on the host and recording backends a hook runs when its
    # stream reached it, so the caller's earlier work is complete already.
    def wait_for_caller(self, caller: Stream) -> None:
        del caller

    def make_caller_wait(self, caller: Stream) -> None:
        del caller
        self.drain()

    def close(self) -> None:
        self._queue.put(None)
