"""The deployment's secret on the rendezvous store: MACs on the values, pair tokens derived from it.

On any store (these run on torch's HashStore: the guarded store that admits members only is
tests/mrv2/test_guarded_store.py), a process without the secret cannot write a value a member takes, cannot
stop the deployment, and cannot present a pair's token: the store holds only a nonce.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from afd_mrv2.errors import AfdError
from afd_mrv2.hooks.p2p import Pair, tcp_channel
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2.transport.store import PREFIX, PairTransport, RendezvousStore, StrangerValue
from afd_mrv2.placement import Placement

SECRET = b"s" * 32
RING = Placement.ring(4, 2, 1)


def test_values_carry_the_mac_and_a_value_a_stranger_wrote_is_refused_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = dist.HashStore()
    member = RendezvousStore(raw, transport=PairTransport("tcp", "127.0.0.1"), secret=SECRET)
    member.mark_lost(FFN, 1)
    assert raw.get(f"{PREFIX}/f1/lost").decode().startswith("0\x1f")  # the value, then its MAC
    assert member.lost_incarnation(FFN, 1) == 0 and not member.stop_requested()
    raw.set(f"{PREFIX}/stop", "1")  # a stranger: no MAC
    raw.set(f"{PREFIX}/f1/lost", "7")
    assert not member.stop_requested() and member.lost_incarnation(FFN, 1) == 0
    with pytest.raises(StrangerValue, match="lacks the deployment's MAC"):
        member._value(f"{PREFIX}/f1/lost")
    warned = [r.getMessage() for r in caplog.records if "refused the value" in r.getMessage()]
    assert warned and f"{PREFIX}/stop" in warned[0], warned
    other = RendezvousStore(raw, transport=PairTransport("tcp", "127.0.0.1"), secret=b"o" * 32)
    member.request_stop()
    assert member.stop_requested() and not other.stop_requested()  # another secret is a stranger too


def test_gloo_pairs_are_refused_with_a_secret() -> None:
    store = RendezvousStore(dist.HashStore(), transport=PairTransport("gloo"), secret=SECRET)
    with pytest.raises(AfdError, match="gloo cannot be guarded"):
        store.join_pair(FFN, (0, 1), (0, 1), placement=RING.stamp)


def test_a_tcp_pair_joins_with_a_derived_token_and_a_reader_of_the_store_cannot_present_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = dist.HashStore()
    store = RendezvousStore(raw, transport=PairTransport("tcp", "127.0.0.1"), secret=SECRET)
    joined: dict[str, Any] = {}

    def join(role: str) -> None:
        # neither side gives up: the FFN side may finish before the Attention side's connect has returned,
        # and a give_up keyed on it then turned that connect into None (a CI failure once)
        joined[role] = store.join_pair(role, (0, 1), (1, 1), placement=RING.stamp)

    ffn = threading.Thread(target=join, args=(FFN,), daemon=True)
    ffn.start()
    key = f"{PREFIX}/a0.1-f1.1/tcp/endpoint"
    raw.wait([key])
    published = tcp_channel.Endpoints.from_json(raw.get(key).decode().rpartition("\x1f")[0])
    host, port = published.endpoint.rsplit(":", 1)
    stranger = socket.create_connection((host, int(port)), timeout=30)  # presents what the store holds
    stranger.sendall(b"afd-tcp-token:" + published.token.encode())
    join(ATTENTION)
    ffn.join(30)
    assert stranger.recv(64) == b""  # closed, nothing sent
    stranger.close()
    attention, served = joined[ATTENTION], joined[FFN]
    assert isinstance(attention, Pair) and isinstance(served, Pair), joined
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert refusals == ["tcp pair a0.1-f1.1: refused a connection from 127.0.0.1: a wrong token"], refusals
    sent, got = torch.arange(4, dtype=torch.float32), torch.zeros(4)
    send = attention.channel.post("send", sent, 3, "four floats")
    receive = served.channel.post("recv", got, 3, "four floats")
    assert receive.await_done(10) and send.await_done(10) and torch.equal(sent, got)
    for pair in (attention, served):
        pair.channel.close()
