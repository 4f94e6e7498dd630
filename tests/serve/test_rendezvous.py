"""The rendezvous store serve hosts (``afd.rendezvous: external``): what it writes there, read back as the
roles read it (:class:`~afd_mrv2.mrv2.transport.store.RendezvousStore`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from afd_mrv2.errors import AfdError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2.transport.store import RendezvousStore
from afd_mrv2.procs import free_port
from afd_mrv2.serve.rendezvous import RendezvousHost


def _soon(seen: Callable[[], bool], within_s: float = 5.0) -> bool:
    """Whether ``seen()`` turns true within ``within_s``: torch's TCPStore answers a ``set`` before its server
    applied it, so another client's read right after may not see it yet (1 in ~20 runs did not)."""
    deadline = time.monotonic() + within_s
    while not seen():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("secret", [None, b"s" * 32], ids=["tcpstore", "guarded"])
def test_serve_hosts_the_store_marks_losses_and_stops_it(secret: bytes | None) -> None:
    port = free_port()
    host = RendezvousHost({"rendezvous": "external", "port": port}, "127.0.0.1", secret=secret)
    host.start()
    role = RendezvousStore.connect("127.0.0.1", port, master=False, timeout_s=10, secret=secret)
    role.register(FFN, 1)
    assert _soon(lambda: host.store is not None and host.store.latest(FFN, 1) == 1)
    host.mark_lost(FFN, 1)  # serve saw FFN rank 1's first process exit
    host.mark_lost(ATTENTION, 0)  # never registered: its incarnation 0 is marked
    assert _soon(lambda: role.lost_incarnation(FFN, 1) == 1 and role.lost_incarnation(ATTENTION, 0) == 0)
    assert not role.stop_requested()
    host.stop()
    assert _soon(role.stop_requested)


def test_another_rendezvous_hosts_nothing_and_writes_nothing() -> None:
    host = RendezvousHost({"rendezvous": "ffn0", "port": free_port()}, "127.0.0.1")
    host.start()
    host.mark_lost(FFN, 0)
    host.stop()
    assert host.store is None


def test_a_port_it_cannot_bind_is_one_line_naming_it() -> None:
    port = free_port()
    first = RendezvousHost({"rendezvous": "external", "port": port}, "127.0.0.1")
    first.start()
    with pytest.raises(AfdError, match=rf"^cannot host the AFD rendezvous store on 127\.0\.0\.1:{port}: ") as info:
        RendezvousHost({"rendezvous": "external", "port": port}, "127.0.0.1").start()
    assert "\n" not in str(info.value)
