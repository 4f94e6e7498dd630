"""The rendezvous store's key layout, incarnations, lost marks, stop key and pair handshake
(:class:`~afd_mrv2.mrv2.transport.store.RendezvousStore`), on an in-process store."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from afd_mrv2.hooks.p2p import Pair
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2.transport.store import PREFIX, RendezvousStore, pair_name


@pytest.fixture
def raw() -> dist.Store:
    return dist.HashStore()


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


def test_a_side_gives_up_on_a_pair_whose_peer_never_says_hello(raw: dist.Store) -> None:
    store = RendezvousStore(raw)
    looks = [0]

    def give_up() -> bool:
        looks[0] += 1
        return looks[0] > 3

    assert store.join_pair(FFN, (0, 1), (1, 1), give_up=give_up) is None
    assert raw.check([f"{PREFIX}/a0.1-f1.1/hello/ffn"]) and not raw.check([f"{PREFIX}/a0.1-f1.1/hello/attention"])


def test_both_sides_join_the_pair_named_by_their_incarnations_and_exchange_on_it() -> None:
    store = RendezvousStore(dist.HashStore())
    joined: dict[str, Any] = {}

    def join(role: str) -> None:
        try:
            joined[role] = store.join_pair(role, (0, 1), (1, 2), idle_timeout_s=30)
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
    sent, got = torch.arange(4, dtype=torch.float32), torch.zeros(4)
    send = attention.group.send([sent], attention.peer, 7)
    ffn.group.recv([got], ffn.peer, 7).wait()
    send.wait()
    assert torch.equal(sent, got)
