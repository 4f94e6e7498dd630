"""Fixtures of the MRV2 tests.

``transport``: what torch_p2p's pairs run on (``afd.transport``), each test that takes it runs once per
kind (ids ``gloo``, ``zmq`` and ``tcp``): failover, rejoin, incarnations and deadlines must behave the same on both.
"""

from __future__ import annotations

import pytest

from afd_mrv2.config import TRANSPORTS


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """``gloo``, ``zmq`` or ``tcp``: pass it to ``afd(..., transport=transport)``."""
    kind: str = request.param
    return kind
