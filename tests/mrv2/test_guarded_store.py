"""The guarded store (afd_mrv2.mrv2.transport.guarded_store): members only, torch's store calls with their meaning.

A process without the deployment's secret gets the store's challenge and nothing else, and is logged: a raw
socket that sends nothing or a wrong proof, torch's own TCPStore client, a member of another deployment.  A
member that reaches a store which cannot prove the secret is told so.  RendezvousStore runs on it whenever it
has a secret.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from afd_mrv2.items import FFN
from afd_mrv2.mrv2.transport import guarded_store
from afd_mrv2.mrv2.transport.guarded_store import CHALLENGE, HELLO, PROOF, GuardedStore, StoreError
from afd_mrv2.mrv2.transport.store import PairTransport, RendezvousStore
from afd_mrv2.procs import free_port

SECRET = b"k" * 32
SHORT = datetime.timedelta(seconds=3)


@pytest.fixture
def host() -> Iterator[GuardedStore]:
    store = GuardedStore("127.0.0.1", free_port(), secret=SECRET, master=True, timeout=SHORT)
    yield store
    store.close()


def _member(host: GuardedStore, secret: bytes = SECRET) -> GuardedStore:
    addr, port = host.where.rsplit(":", 1)
    return GuardedStore(addr, int(port), secret=secret, master=False, timeout=SHORT)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]


def _nothing_more(sock: socket.socket) -> bool:
    """True when the store closed ``sock`` (an end of stream, or a reset for what it left unread) having sent
    no byte more."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_members_share_the_store_calls_of_torchs_store(host: GuardedStore) -> None:
    member = _member(host)
    host.set("a", "1")
    assert member.get("a") == b"1" and member.check(["a"]) and not member.check(["a", "b"])
    assert [member.add("n", 1), host.add("n", 2), member.add("n", 0)] == [1, 3, 3]
    assert member.get("n") == b"3"  # a counter reads as its decimal text, as torch's
    member.set("bin", b"\x00\xff\x1f")
    assert host.get("bin") == b"\x00\xff\x1f"
    late = threading.Timer(0.3, host.set, args=("later", "x"))
    late.start()
    assert member.get("later") == b"x"  # get waits for its key
    member.wait(["later", "a"])
    assert host.delete_key("a") and not member.check(["a"]) and not host.delete_key("a")
    started = time.monotonic()
    with pytest.raises(StoreError, match="no value for never within 3 s"):
        member.get("never")
    assert 2.5 < time.monotonic() - started < 6


def test_a_stranger_gets_the_challenge_and_nothing_else_and_is_logged(
    host: GuardedStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(guarded_store, "PROVE_WITHIN_S", 0.5)
    addr, port = host.where.rsplit(":", 1)
    host.set("afd_mrv2/p2p/f0/incarnation", "1")
    wrong = socket.create_connection((addr, int(port)), timeout=10)
    hello = wrong.recv(len(HELLO) + CHALLENGE, socket.MSG_WAITALL)
    assert hello.startswith(HELLO) and len(hello) == len(HELLO) + CHALLENGE
    wrong.sendall(b"\x00" * (PROOF + CHALLENGE) + b'{"op": "get", "key": "afd_mrv2/p2p/f0/incarnation"}')
    assert _nothing_more(wrong)  # closed: no proof of its own, no value
    silent = socket.create_connection((addr, int(port)), timeout=10)
    silent.recv(len(HELLO) + CHALLENGE, socket.MSG_WAITALL)
    assert _nothing_more(silent)  # closed after PROVE_WITHIN_S, having sent nothing
    assert _refusals(caplog) == [
        f"rendezvous store on {host.where}: refused a connection from 127.0.0.1: a wrong proof (not the "
        "deployment's secret)",
        f"rendezvous store on {host.where}: refused a connection from 127.0.0.1: no proof of the deployment's "
        "secret within 0.5 s",
    ]
    assert _member(host).get("afd_mrv2/p2p/f0/incarnation") == b"1"  # members still served


def test_torchs_store_client_and_another_deployment_are_refused(
    host: GuardedStore, caplog: pytest.LogCaptureFixture
) -> None:
    addr, port = host.where.rsplit(":", 1)
    with pytest.raises((RuntimeError, OSError)):
        dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=2))
    with pytest.raises(StoreError, match="refused this process: it does not hold the deployment's secret"):
        _member(host, secret=b"o" * 32)
    assert any("a wrong proof" in line for line in _refusals(caplog)), _refusals(caplog)


def test_a_member_is_told_when_the_store_cannot_prove_the_secret() -> None:
    """A process listening on the store's port that is no store of this deployment (it replays whatever)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(HELLO + b"c" * CHALLENGE)
            conn.recv(PROOF + CHALLENGE, socket.MSG_WAITALL)
            conn.sendall(b"p" * PROOF)

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(StoreError, match="cannot prove the deployment's secret: not this deployment's store"):
        GuardedStore("127.0.0.1", port, secret=SECRET, master=False, timeout=SHORT)
    listener.close()


def test_the_store_binds_its_address_only() -> None:
    """Bound to 127.0.0.2 (a loopback address of its own on Linux), nothing answers on 127.0.0.1."""
    port = free_port()
    store = GuardedStore("127.0.0.2", port, secret=SECRET, master=True, timeout=SHORT)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        store.close()


def test_a_member_calls_on_a_closed_store_fail_in_one_line(host: GuardedStore) -> None:
    member = _member(host)
    host.close()
    with pytest.raises(StoreError, match=f"the rendezvous store on {host.where}: "):
        member.add("n", 1)
    with pytest.raises(StoreError, match="is gone"):
        member.check(["n"])


def test_rendezvous_store_runs_on_the_guarded_store_with_a_secret() -> None:
    port = free_port()
    tcp = PairTransport("tcp", "127.0.0.1")
    node0 = RendezvousStore.connect("127.0.0.1", port, master=True, timeout_s=3, transport=tcp, secret=SECRET)
    role = RendezvousStore.connect("127.0.0.1", port, master=False, timeout_s=3, transport=tcp, secret=SECRET)
    assert isinstance(node0._store, GuardedStore)
    assert role.register(FFN, 1) == 1 and node0.latest(FFN, 1) == 1
    node0.request_stop()
    assert role.stop_requested()
    with pytest.raises(StoreError, match="refused this process"):
        RendezvousStore.connect("127.0.0.1", port, master=False, timeout_s=3, transport=tcp, secret=b"x" * 32)
