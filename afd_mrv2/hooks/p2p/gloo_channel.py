"""GlooChannel: a :class:`~afd_mrv2.hooks.p2p.channel.Channel` on a torch.distributed group.

A post calls ``ProcessGroup.send``/``recv`` directly (``dist.isend``/``irecv`` add about 20 us of
Python checks per call).  Gloo's work objects only complete inside ``wait()``, so each
(tag, direction) has a watcher: a daemon thread that waits on its operations in posting order
and sets each Pending's ``done``.  One group may carry several channels (a one-group link: one
per peer rank ``dst``).  See docs/internals/p2p-transport.md.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from afd_mrv2.hooks.p2p.channel import Channel, Pending


class _Watcher:
    """Waits on the operations of one tag and direction, in posting order, on a daemon thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def add(self, pending: Pending) -> None:
        self._queue.put(pending)

    def _loop(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                pending.work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting hook
                pending.error = exc
            pending.done_at = time.perf_counter()
            pending.work = None
            pending.done.set()


class GlooChannel(Channel):
    """The transfers with rank ``dst`` of ``group`` (a torch.distributed ProcessGroup, or any object with
    its ``send``/``recv``); see the module docstring."""

    transport = "gloo"

    def __init__(self, group: Any, dst: int) -> None:
        self.group = group
        self.dst = dst
        self._watchers: dict[tuple[int, str], _Watcher] = {}
        self._lock = threading.Lock()

    def post(self, direction: str, tensor: torch.Tensor, tag: int, what: str) -> Pending:
        """Post the operation (a RuntimeError when the group is already closed) and hand it to its watcher."""
        op = self.group.send if direction == "send" else self.group.recv
        posted_at = time.perf_counter()
        work = op([tensor], self.dst, tag)
        pending = Pending(work, direction, tensor, self.dst, what, self)
        pending.posted_at = posted_at
        with self._lock:
            watcher = self._watchers.get((tag, direction))
            if watcher is None:
                watcher = self._watchers[(tag, direction)] = _Watcher(f"afd-p2p-{direction}-{self.dst}-{tag:x}")
        watcher.add(pending)
        return pending

    def await_done(self, pending: Pending, slice_s: float) -> bool:
        return pending.done.wait(slice_s)

    def close(self) -> None:
        """Nothing to release here: the group is its owner's (operations still posted end on their own)."""
