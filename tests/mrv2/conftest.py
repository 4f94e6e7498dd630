"""Fixtures of the MRV2 tests.

``transport``: what torch_p2p's pairs run on (``afd.transport``), each test that takes it runs once per
kind of :data:`PROCESS_TRANSPORTS` (ids ``gloo`` and ``tcp``): failover, rejoin, incarnations and deadlines
must behave the same on both.
"""

from __future__ import annotations

import pytest

#: The transports the tests of whole processes (failover, rejoin, the embedded run's faults) run on: tcp, the
#: default, and gloo, kept for comparison.  zmq's channel meets the same contract in the channel-level tests
#: (tests/hooks/p2p/test_link_channels.py, test_reader_channels.py) and its handshake in
#: test_rendezvous_store.py; running every process test on it too cost ~40 s of the 10-minute unit run.
PROCESS_TRANSPORTS = ("gloo", "tcp")


@pytest.fixture(params=PROCESS_TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """``gloo`` or ``tcp``: pass it to ``afd(..., transport=transport)``."""
    kind: str = request.param
    return kind
