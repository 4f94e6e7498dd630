"""ReaderChannel: what the channels whose waiter reads (zmq, tcp) share (RFC 0007, decisions 4-7).

Receives are matched per tag in posting order; a message for a tag with no posted receive is kept (at
most ``max_kept`` per tag) and copied in when one is posted; one waiter at a time holds the receive side
(:meth:`ReaderChannel._take_reader`), the others wait on the channel's condition; a loss fails every
posted and later Pending once.  Subclasses move the bytes: ``_post_send`` and ``_read_until``.
"""

from __future__ import annotations

import abc
import collections
import math
import threading
import time
from typing import Any

import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.channel import Channel, ChannelError, Flag, Pending


def finish(pending: Pending, error: BaseException | None, at: float | None = None) -> None:
    """Complete ``pending`` (failed when ``error``) at ``at`` (default now)."""
    pending.error = error
    pending.done_at = time.perf_counter() if at is None else at
    pending.done.set()


class ReaderChannel(Channel):
    """The matching, kept messages, waiters and loss of a channel whose waiter reads; see the module
    docstring.  ``flags``: Pendings carry a :class:`~afd_mrv2.hooks.p2p.channel.Flag`, not an Event."""

    def __init__(self, *, peer: int, name: str, send_timeout_s: float, max_kept: int, flags: bool) -> None:
        self.peer, self.name = peer, name
        self._send_timeout_s, self._max_kept, self._flags = send_timeout_s, max_kept, flags
        self._cond = threading.Condition()  # guards the fields below
        self._reading = False  # a waiter holds the receive side
        self._posted: dict[int, collections.deque[Pending]] = collections.defaultdict(collections.deque)
        self._kept: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self.lost: ChannelError | None = None  # set once, with lost_at
        self.lost_at = math.inf
        self._send_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ posting

    def post(self, direction: str, tensor: torch.Tensor, tag: int, what: str) -> Pending:
        view = wire.host_bytes(tensor)
        pending = Pending(None, direction, tensor, self.peer, what, self, Flag() if self._flags else None)
        pending.posted_at, pending.tag = time.perf_counter(), tag
        if direction == "send":
            self._post_send(pending, tag, view)
            return pending
        with self._cond:
            kept = self._kept.get(tag)
            if kept:
                message = kept.popleft()
            elif self.lost is not None:
                finish(pending, self.lost)
                return pending
            else:
                self._posted[tag].append(pending)
                return pending
        self._deliver(pending, tag, message)
        return pending

    @abc.abstractmethod
    def _post_send(self, pending: Pending, tag: int, view: memoryview) -> None:
        """Send ``view`` under ``tag``; complete ``pending`` (done, or failed)."""

    def _deliver(self, pending: Pending, tag: int, message: Any) -> None:
        """Copy a kept ``message`` (bytes-like) into ``pending``'s tensor, or fail it on a size mismatch."""
        if len(message) == pending.nbytes:
            wire.host_bytes(pending.tensor)[:] = message
            finish(pending, None)
        else:
            finish(pending, self._mismatch(pending, tag, len(message)))

    def _keep(self, tag: int, message: Any) -> bool:
        """A message no posted receive took: hand it to one posted meanwhile, else keep it; True when that
        completed a receive, or lost the channel for keeping too many of that tag (waiters should look)."""
        with self._cond:
            posted = self._posted.get(tag)
            pending = posted.popleft() if posted else None
            if pending is None:
                self._kept[tag].append(message)
                overflow = len(self._kept[tag]) > self._max_kept
        if pending is not None:
            self._deliver(pending, tag, message)
            return True
        if overflow:
            self._lose(ChannelError(f"{self._pair}: over {self._max_kept} unreceived messages of tag {tag}"))
        return overflow

    def _take_posted(self, tag: int) -> Pending | None:
        with self._cond:
            posted = self._posted.get(tag)
            return posted.popleft() if posted else None

    # ------------------------------------------------------------------ waiting

    def await_done(self, pending: Pending, slice_s: float) -> bool:
        deadline = time.monotonic() + slice_s
        with self._cond:
            while self._reading and not pending.done.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return pending.done.is_set()
            if pending.done.is_set():
                return True
            self._reading = True
        try:
            self._read_until(pending, deadline)
        finally:
            self._release_reader()
        return pending.done.is_set()

    @abc.abstractmethod
    def _read_until(self, pending: Pending, deadline: float) -> None:
        """As the reader: read until ``pending`` is done or ``deadline`` (``time.monotonic()``) passed."""

    def _take_reader(self) -> bool:
        with self._cond:
            if self._reading or self._closed:
                return False
            self._reading = True
            return True

    def _release_reader(self) -> None:
        with self._cond:
            self._reading = False
            self._cond.notify_all()

    def _wake_waiters(self) -> None:
        """A receive completed by the reader: its waiter may be waiting for the reader to leave."""
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ losses

    @property
    def _pair(self) -> str:
        return f"{self.transport} pair {self.name}"

    def _mismatch(self, pending: Pending, tag: int, nbytes: int) -> ChannelError:
        return ChannelError(
            f"{self._pair}: {pending.what} (tag {tag}) expected {pending.nbytes} bytes, the peer sent {nbytes}"
        )

    def _lose(self, error: ChannelError, *also: Pending | None) -> None:
        """Fail every posted Pending (and ``also``, if not done) with ``error``, once; later posts fail too."""
        with self._cond:
            if self.lost is not None:
                return
            self.lost, self.lost_at = error, time.perf_counter()
            failed = [p for queue in self._posted.values() for p in queue]
            failed += [p for p in also if p is not None and not p.done.is_set()]
            self._posted.clear()
            for pending in failed:
                finish(pending, error, self.lost_at)
            self._cond.notify_all()

    def _close_reading(self) -> bool:
        """Mark the channel closed and take the receive side for good; False when it was closed already."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.wait_for(lambda: not self._reading, timeout=1.0)
            self._reading = True  # nobody reads a closed socket
        return True
