"""Fixtures of the probe and script tests."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture
def signals_restored() -> Iterator[None]:
    """The scripts' ``main`` makes SIGINT and SIGTERM raise KeyboardInterrupt (``guarded``): give pytest its
    own handlers back after a test that calls it in this process."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
