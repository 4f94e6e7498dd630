"""What an Attention side's failovers did: the FFN ranks it lost, its re-sends, its rejoins, and when.

Kept by torch_p2p's round-trip side (:mod:`afd_mrv2.hooks.p2p.roundtrip`), which also writes one
line to stderr for each loss and each rejoin; read by the owner (``RemoteExperts.failovers``, the
live figures behind serve's ``/metrics``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from afd_mrv2.hooks.p2p.errors import PeerError
from afd_mrv2.placement import Placement


class FailoverLog:
    """What failovers this side made (thread-safe): FFN ranks lost, re-sends, and when (``time.time()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0  # FFN ranks failed over
        self.lost_at: dict[int, float] = {}  # FFN rank -> when this side stopped routing to it
        self.first_resend_at: dict[int, float] = {}  # FFN rank -> when its first share was re-sent
        self.resent_items = 0
        self.resent_rows = 0
        self.reasons: dict[int, str] = {}
        self.rejoined_at: dict[int, float] = {}  # FFN rank -> when this side last took it back
        self.rejoins = 0

    def lost(self, ffn: int, loss: PeerError, moved: list[int], live: frozenset[int], me: str) -> None:
        """``ffn`` is lost: the experts it computed (``moved``) go to their next holders among ``live``."""
        now = time.time()
        with self._lock:
            self.count += 1
            self.lost_at[ffn] = now
            self.reasons[ffn] = str(loss).splitlines()[0]
        line = (
            f"afd-mrv2 failover: {me}: FFN rank {ffn} lost ({type(loss).__name__}); the experts it computed, "
            f"{Placement.ranges(moved)}, go to their next live holders, FFN ranks {sorted(live)} (at {now:.3f})"
        )
        sys.stderr.flush()
        os.write(2, f"{line}\n".encode())

    def rejoined(self, ffn: int, pair: str, me: str) -> None:
        now = time.time()
        with self._lock:
            self.rejoins += 1
            self.rejoined_at[ffn] = now
        line = (
            f"afd-mrv2 rejoin: {me}: FFN rank {ffn} is back (pair {pair}); routing to it from this step (at {now:.3f})"
        )
        sys.stderr.flush()
        os.write(2, f"{line}\n".encode())

    def resent(self, ffn: int, rows: int) -> None:
        with self._lock:
            self.first_resend_at.setdefault(ffn, time.time())
            self.resent_items += 1
            self.resent_rows += rows

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "failovers": self.count,
                "lost": {
                    str(f): {"at": round(t, 3), "reason": self.reasons[f]} for f, t in sorted(self.lost_at.items())
                },
                "first_resend_at": {str(f): round(t, 3) for f, t in sorted(self.first_resend_at.items())},
                "resent_items": self.resent_items,
                "resent_rows": self.resent_rows,
                "rejoins": self.rejoins,
                "rejoined_at": {str(f): round(t, 3) for f, t in sorted(self.rejoined_at.items())},
            }
