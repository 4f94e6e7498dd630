"""The rendezvous store's key layout, incarnations, lost marks, stop key and pair handshake
(:class:`~afd_mrv2.mrv2.transport.store.RendezvousStore`), on an in-process store; the placement check of
the handshake between two processes on a real TCPStore."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from afd_mrv2.errors import AfdError
from afd_mrv2.hooks.p2p import Pair, tcp_channel, zmq_channel
from afd_mrv2.hooks.p2p.channel import ChannelError
from afd_mrv2.hooks.p2p.gloo_channel import GlooChannel
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2.transport.store import (
    PREFIX,
    PairTransport,
    PlacementMismatch,
    RendezvousStore,
    pair_name,
    route_address,
)
from afd_mrv2.placement import Placement
from afd_mrv2.procs import free_port
from afd_mrv2.topology import Topology

RING = Placement.ring(8, 2)


@pytest.fixture
def raw() -> dist.Store:
    return dist.HashStore()


CHANNELS = {"gloo": GlooChannel, "zmq": zmq_channel.ZmqChannel, "tcp": tcp_channel.TcpChannel}


@pytest.fixture(params=sorted(CHANNELS))
def transport(request: pytest.FixtureRequest) -> PairTransport:
    return PairTransport(request.param, None if request.param == "gloo" else "127.0.0.1")


def test_incarnations_count_per_rank_and_carry_the_process_label(raw: dist.Store) -> None:
    store = RendezvousStore(raw)
    assert store.latest(FFN, 1) == 0 and store.label(FFN, 1, 1) == ""  # nothing registered: never blocks
    assert [store.register(FFN, 1), store.register(FFN, 1), store.register(ATTENTION, 1)] == [1, 2, 1]
    assert store.latest(FFN, 1) == 2 and store.latest(FFN, 0) == 0 and store.latest(ATTENTION, 1) == 1
    assert store.label(FFN, 1, 2) == f"pid {os.getpid()} on {socket.gethostname()}"
    # the documented layout, under one prefix
    assert raw.get(f"{PREFIX}/f1/incarnation") == b"2" and raw.check([f"{PREFIX}/a1.1/label"])


def test_a_lost_mark_names_the_latest_incarnation_and_the_stop_key_is_set_once_asked(raw: dist.Store) -> None:
    store = RendezvousStore(raw)
    assert store.lost_incarnation(FFN, 0) == 0 and not store.stop_requested()
    store.register(FFN, 0)
    store.register(FFN, 0)
    store.mark_lost(FFN, 0)
    store.register(FFN, 0)  # the restarted process: not lost
    assert store.lost_incarnation(FFN, 0) == 2 and store.lost_incarnation(ATTENTION, 0) == 0
    store.request_stop()
    assert store.stop_requested() and raw.check([f"{PREFIX}/stop"])


def test_a_side_gives_up_on_a_pair_whose_peer_never_says_hello(raw: dist.Store, transport: PairTransport) -> None:
    store = RendezvousStore(raw, transport=transport)
    looks = [0]

    def give_up() -> bool:
        looks[0] += 1
        return looks[0] > 3

    assert store.join_pair(FFN, (0, 1), (1, 1), placement=RING.stamp, give_up=give_up) is None
    assert raw.check([f"{PREFIX}/a0.1-f1.1/hello/ffn"]) and not raw.check([f"{PREFIX}/a0.1-f1.1/hello/attention"])
    # on zmq and tcp the FFN side published where it listens before its hello (and closed that socket on giving up)
    assert raw.check([f"{PREFIX}/a0.1-f1.1/{transport.kind}/endpoint"]) == (transport.kind != "gloo")


def test_transport_kinds_and_the_default_bind_address() -> None:
    with pytest.raises(ValueError, match="transport 'nccl': not one of gloo, zmq, tcp"):
        RendezvousStore(dist.HashStore(), transport=PairTransport("nccl"))
    assert route_address("127.0.0.1", 29500) == "127.0.0.1"
    port = free_port()
    store = RendezvousStore.connect("127.0.0.1", port, master=True, timeout_s=10, transport=PairTransport("zmq"))
    assert store.transport == PairTransport("zmq", "127.0.0.1")  # the route to the store's host
    tcp = RendezvousStore(dist.HashStore(), transport=PairTransport("tcp"))
    assert tcp.transport == PairTransport("tcp")  # bound at join time to loopback when not given


@pytest.mark.parametrize("kind", ["zmq", "tcp"])
def test_an_address_this_host_cannot_bind_fails_the_join_in_one_line_naming_afd_bind(
    raw: dist.Store, kind: str
) -> None:
    store = RendezvousStore(raw, transport=PairTransport(kind, "203.0.113.7"))  # TEST-NET-3: not this host's
    with pytest.raises(AfdError, match=r"^afd\.bind: cannot bind '203\.0\.113\.7' for pair a0\.1-f1\.1: "):
        store.join_pair(FFN, (0, 1), (1, 1), placement=RING.stamp, give_up=lambda: True)
    assert not raw.check([f"{PREFIX}/a0.1-f1.1/hello/ffn"])  # refused before saying hello


def test_a_zmq_pair_whose_token_is_wrong_fails_the_join_in_one_line_naming_the_pair(raw: dist.Store) -> None:
    """A stray connection (here: the Attention side reads a tampered token) is a failed join, never a mixed pair."""
    store = RendezvousStore(raw, transport=PairTransport("zmq", "127.0.0.1"))
    joined: dict[str, Any] = {}

    def join(role: str) -> None:
        try:
            joined[role] = store.join_pair(role, (0, 1), (1, 1), placement=RING.stamp, give_up=lambda: len(joined) > 0)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            joined[role] = exc

    ffn = threading.Thread(target=join, args=(FFN,), daemon=True)
    ffn.start()
    key = f"{PREFIX}/a0.1-f1.1/zmq/endpoint"
    raw.wait([key])
    endpoints = zmq_channel.ZmqEndpoints.from_json(raw.get(key).decode())
    raw.set(key, zmq_channel.ZmqEndpoints(endpoints.endpoint, "0" * 32).to_json())
    join(ATTENTION)
    ffn.join(60)
    assert isinstance(joined[FFN], ChannelError), joined
    assert str(joined[FFN]) == "zmq pair a0.1-f1.1: the peer sent a wrong token (not this pair's peer)"


def _established_to(port: int) -> int:
    """Connections on this host to local port ``port`` in state ESTABLISHED, their connecting ends
    (``/proc/net/tcp``: remote address field, state 01), whether or not accepted yet."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if int(row[2].split(":")[1], 16) == port and row[3] == "01")


def test_a_tcp_stranger_without_the_token_is_refused_and_logged_and_the_pair_still_joins(
    raw: dist.Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection to the FFN side's pair port that presents another token gets nothing but a close; the
    listener logs it and goes on waiting for the pair's own peer.  An Attention side that read a tampered token
    is refused in one line naming the pair."""
    store = RendezvousStore(raw, transport=PairTransport("tcp", "127.0.0.1"))
    joined: dict[str, Any] = {}

    def join(who: str, on: RendezvousStore = store) -> None:
        role = FFN if who == FFN else ATTENTION
        # the misled side never gives up: its refusal must come as an error, even once the real pair joined
        give_up = (lambda: False) if who == "misled" else (lambda: FFN in joined)
        try:
            joined[who] = on.join_pair(role, (0, 1), (1, 1), placement=RING.stamp, give_up=give_up)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            joined[who] = exc

    ffn = threading.Thread(target=join, args=(FFN,), daemon=True)
    ffn.start()
    key = f"{PREFIX}/a0.1-f1.1/tcp/endpoint"
    raw.wait([key])
    endpoints = tcp_channel.Endpoints.from_json(raw.get(key).decode())
    host, port = endpoints.endpoint.rsplit(":", 1)
    stranger = socket.create_connection((host, int(port)), timeout=30)  # queued until the pair's hellos
    stranger.sendall(b"afd-tcp-token:" + b"0" * 32)
    tampered = dist.HashStore()
    tampered.set(f"{PREFIX}/a0.1-f1.1/hello/ffn", "1")
    tampered.set(f"{PREFIX}/a0.1-f1.1/placement/ffn", raw.get(f"{PREFIX}/a0.1-f1.1/placement/ffn"))
    tampered.set(key, tcp_channel.Endpoints(endpoints.endpoint, "f" * 32).to_json())
    misled = threading.Thread(target=join, args=("misled", RendezvousStore(tampered, transport=store.transport)))
    misled.start()
    deadline = time.monotonic() + 30
    while _established_to(int(port)) < 2:  # the stranger's and the misled side's, queued at the listener
        assert time.monotonic() < deadline and misled.is_alive(), joined
        time.sleep(0.01)
    join(ATTENTION)
    misled.join(30)
    ffn.join(30)
    assert stranger.recv(64) == b""  # closed, nothing sent
    stranger.close()
    assert isinstance(joined[FFN], Pair) and isinstance(joined[ATTENTION], Pair), joined
    assert isinstance(joined["misled"], ChannelError)
    assert str(joined["misled"]).startswith("tcp pair a0.1-f1.1: the peer refused this side's token"), joined
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert refusals[0] == "tcp pair a0.1-f1.1: refused a connection from 127.0.0.1: a wrong token", refusals
    assert refusals == [refusals[0]] * 2, refusals  # the stranger, and the misled side
    for pair in (joined[FFN], joined[ATTENTION]):
        pair.channel.close()


def test_both_sides_join_the_pair_named_by_their_incarnations_and_exchange_on_it(transport: PairTransport) -> None:
    store = RendezvousStore(dist.HashStore(), transport=transport)
    joined: dict[str, Any] = {}

    def join(role: str) -> None:
        try:
            joined[role] = store.join_pair(role, (0, 1), (1, 2), placement=RING.stamp, idle_timeout_s=30)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            joined[role] = exc

    threads = [threading.Thread(target=join, args=(role,), daemon=True) for role in (ATTENTION, FFN)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    attention, ffn = joined[ATTENTION], joined[FFN]
    assert isinstance(attention, Pair) and isinstance(ffn, Pair), joined
    assert attention.name == ffn.name == pair_name(0, 1, 1, 2) == "a0.1-f1.2"
    assert (attention.me, attention.peer, ffn.me, ffn.peer) == (0, 1, 1, 0)  # the Attention rank is rank 0
    assert attention.channel.transport == ffn.channel.transport == transport.kind
    assert isinstance(attention.channel, CHANNELS[transport.kind])
    for there, back in ((attention, ffn), (ffn, attention)):  # both directions
        sent, got = torch.arange(4, dtype=torch.float32), torch.zeros(4)
        send = there.channel.post("send", sent, 7, "four floats")
        receive = back.channel.post("recv", got, 7, "four floats")
        assert receive.await_done(10) and send.await_done(10) and receive.error is None
        assert torch.equal(sent, got)
    for pair in (attention, ffn):
        pair.channel.close()


#: The FFN side of a pair, in a process of its own: FFN rank 1 (its first incarnation) on the store at PORT
#: joins the pair with Attention rank 0's first incarnation holding the ring of 8 experts with REPLICAS holders.
FFN_SIDE = """
import sys
from afd_mrv2.items import FFN
from afd_mrv2.mrv2.transport.store import RendezvousStore
from afd_mrv2.placement import Placement
port, replicas = int(sys.argv[1]), int(sys.argv[2])
store = RendezvousStore.connect("127.0.0.1", port, master=False, timeout_s=60)
store.register(FFN, 1)
try:
    pair = store.join_pair(FFN, (0, 1), (1, 1), placement=Placement.ring(8, 2, replicas).stamp, idle_timeout_s=30)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
else:
    print("joined", pair.name, flush=True)
"""


def _pair_across_processes(replicas_on_ffn: int) -> tuple[object, str, str]:
    """(what the Attention side's join_pair gave, the FFN process's one line, the FFN process's label)."""
    port = free_port()
    store = RendezvousStore.connect("127.0.0.1", port, master=True, timeout_s=60)
    store.register(ATTENTION, 0)
    ffn = subprocess.Popen(
        [sys.executable, "-c", FFN_SIDE, str(port), str(replicas_on_ffn)], stdout=subprocess.PIPE, text=True
    )
    try:
        joined: object = store.join_pair(ATTENTION, (0, 1), (1, 1), placement=RING.stamp, idle_timeout_s=30)
    except PlacementMismatch as exc:
        joined = exc
    out, _ = ffn.communicate(timeout=120)
    return joined, out.strip(), f"pid {ffn.pid} on {socket.gethostname()}"


def test_a_pair_whose_sides_hold_different_tables_fails_on_both_sides_in_one_line_naming_both() -> None:
    joined, ffn_line, ffn_label = _pair_across_processes(replicas_on_ffn=2)
    other = Placement.ring(8, 2, 2)
    expected = (
        f"placement mismatch on pair a0.1-f1.1: attention rank 0 (pid {os.getpid()} on {socket.gethostname()}) "
        f"holds {RING.stamp.short} (ring, 8 experts on 2 FFN ranks, 1 replica); "
        f"FFN rank 1 ({ffn_label}) holds {other.stamp.short} (ring, 8 experts on 2 FFN ranks, 2 replicas)"
    )
    assert isinstance(joined, PlacementMismatch) and str(joined) == expected
    assert ffn_line == f"PlacementMismatch {expected}"  # the FFN side raised the same line


def test_a_pair_whose_sides_hold_the_same_table_joins() -> None:
    joined, ffn_line, _ = _pair_across_processes(replicas_on_ffn=1)
    assert isinstance(joined, Pair) and joined.name == "a0.1-f1.1" and ffn_line == "joined a0.1-f1.1"


def test_a_restarted_ffn_rank_with_another_table_is_raised_by_the_rejoiner_at_the_step_boundary() -> None:
    """The rejoiner's thread meets the mismatch; no retry can fix it, so the model's thread raises it (take)."""
    from afd_mrv2.mrv2.transport.rejoin import Rejoiner
    from afd_mrv2.topology import Topology

    store = RendezvousStore(dist.HashStore())
    me = store.register(ATTENTION, 0)
    store.register(FFN, 1)  # the first incarnation, lost
    store.register(FFN, 1)  # the restarted one, holding another table
    ffn_side: dict[str, BaseException] = {}

    def restarted() -> None:
        try:
            store.join_pair(FFN, (0, me), (1, 2), placement=Placement.ring(8, 2, 2).stamp, idle_timeout_s=30)
        except PlacementMismatch as exc:
            ffn_side["raised"] = exc

    thread = threading.Thread(target=restarted, daemon=True)
    thread.start()
    rejoiner = Rejoiner(store, Topology(1, 2, 8), 0, me, {0: 1, 1: 1}, lambda: {1})
    try:
        thread.join(60)
        with pytest.raises(PlacementMismatch, match=r"^placement mismatch on pair a0\.1-f1\.2: attention rank 0 "):
            for _ in range(600):  # the watch looks every 0.5 s
                rejoiner.take()
                threading.Event().wait(0.05)
    finally:
        rejoiner.close()
    assert str(ffn_side["raised"]).endswith(
        "holds " + Placement.ring(8, 2, 2).stamp.short + " (ring, 8 experts on 2 FFN ranks, 2 replicas)"
    )


def test_an_engine_says_which_ffn_rank_it_waits_for_and_gives_up_at_the_join_timeout(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FFN rank 0 registers, rank 1 never does: the engine names rank 1 while it waits, then gives up."""
    from afd_mrv2.mrv2.transport import pairs

    monkeypatch.setattr(pairs, "WAITING_SAY_S", 0.2)
    store = RendezvousStore(dist.HashStore())
    topology = Topology.over(1, Placement.ring(4, 2, 1))
    store.register(FFN, 0)
    ffn0 = threading.Thread(
        target=store.join_pair, args=(FFN, (0, 1), (0, 1)), kwargs={"placement": topology.placement.stamp}, daemon=True
    )
    ffn0.start()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="attention rank 0: FFN rank 1 did not register within 1 s"):
        pairs.open_attention_link(store, topology, 0, connect_timeout_s=1.0)
    assert time.monotonic() - started < 3
    said = [r.getMessage() for r in caplog.records if "has not registered" in r.getMessage()]
    assert said and all(s.startswith("attention rank 0: FFN rank 1 has not registered") for s in said), said


def test_an_ffn_rank_serve_marked_lost_is_dropped_from_the_link_so_a_wait_on_it_fails_over_at_once() -> None:
    """A cut link sends no reset: the engine's wait on the FFN rank would last recv_timeout_s.  Serve marks the
    rank lost in the store (its node silent); the rejoiner's thread drops it from the link within a look, so the
    wait raises PeerLost (which the connector fails over) naming serve's mark."""
    from afd_mrv2.hooks.p2p import wire
    from afd_mrv2.hooks.p2p.errors import PeerLost
    from afd_mrv2.mrv2.transport.rejoin import Rejoiner
    from tests.hooks.p2p.channel_links import channel_links

    topology = Topology(1, 1, 2)
    store = RendezvousStore(dist.HashStore())
    me = store.register(ATTENTION, 0)
    assert store.register(FFN, 0) == 1
    with channel_links(topology, "tcp") as (attention, _ffn):
        rejoiner = Rejoiner(store, topology, 0, me, {0: 1}, lambda: set(), link=attention)
        try:
            pending = attention.irecv(torch.zeros(8, dtype=torch.int64), 1, wire.TAG_COMBINE, "combine")
            threading.Timer(0.3, store.mark_lost, args=(FFN, 0)).start()
            started = time.monotonic()
            with pytest.raises(PeerLost, match=r"serve marked it lost .* \[incarnation 1\]"):
                attention.wait([pending], timeout_s=30, work=None, action="receiving", option="recv_timeout_s")
            assert time.monotonic() - started < 3.0  # a look every 0.5 s, not the 30 s deadline
        finally:
            rejoiner.close()
