"""Where a round trip goes: the stamp accumulators, their breakdown, and a real round trip through the
torch_p2p round-trip Attention side and the FFN side on a zmq loopback pair (two threads of this process,
one clock)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from afd_mrv2.api import InFlightSink
from afd_mrv2.hooks.p2p import P2pShape, parse_options
from afd_mrv2.hooks.p2p.ffn import FfnSide
from afd_mrv2.hooks.p2p.link import PeerLink
from afd_mrv2.hooks.p2p.roundtrip import RoundTripAttentionSide
from afd_mrv2.hooks.p2p.stamps import SPANS, AttentionStamps, FfnStamps, breakdown
from afd_mrv2.items import WorkItem
from afd_mrv2.topology import Topology
from afd_mrv2.work import INPUT, OUTPUT, BufferSlot, Work
from tests.hooks.p2p.channel_links import channel_links

NINE = [name for name, _, _ in SPANS]
#: Attention stamps of one item (ns) and the FFN's, on one clock: each span below is known
ONE_ITEM_A = (1_000, 1_400, 1_500, 1_600, 9_000, 9_700, 10_000)
ONE_ITEM_F = (2_500, 3_000, 7_000, 7_200)


def _sides(items: int, attention: tuple[int, ...], ffn: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    a, f = AttentionStamps(), FfnStamps()
    for _ in range(items):
        a.add(*attention)
        f.add(*ffn)
    return a.as_dict(), f.as_dict()


def test_an_accumulator_gives_the_mean_of_each_point_floored_and_its_count() -> None:
    stamps = FfnStamps()
    assert stamps.as_dict() == {"items": 0, "means_ns": {}}
    stamps.add(10, 20, 30, 41)
    stamps.add(12, 22, 33, 40)
    got = stamps.as_dict()
    assert got == {
        "items": 2,
        "means_ns": {"payload_done": 11, "compute_called": 21, "compute_returned": 31, "combine_send": 40},
    }


def test_threads_adding_at_once_lose_no_item() -> None:
    stamps = AttentionStamps()
    big = 10**16  # a clock reading of a host up for months: the sums pass 2**64, the means stay exact

    def add() -> None:
        for i in range(500):
            stamps.add(big, big + 1, big + 2, big + 3, big + 4, big + 5, big + 6 + i % 2)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = stamps.as_dict()
    assert got["items"] == 2000
    assert got["means_ns"]["entered"] == big and got["means_ns"]["unpacked"] == big + 6  # (6 + 7) / 2 floored


def test_breakdown_of_known_stamps() -> None:
    attention, ffn = _sides(3, ONE_ITEM_A, ONE_ITEM_F)
    got = breakdown(attention, ffn)
    expected = [0.4, 0.1, 1.0, 0.5, 4.0, 0.2, 1.8, 0.7, 0.3]  # us
    assert [got[name] for name in NINE] == pytest.approx(expected)
    assert got["sum"] == pytest.approx(9.0) and got["round trip"] == pytest.approx(9.0)
    assert got["sends"] == pytest.approx(0.1) and got["wire out + back"] == pytest.approx(2.8)
    assert got["items"] == {"attention": 3, "ffn": 3}


def test_sides_that_counted_other_items_give_no_joined_span() -> None:
    attention, _ = _sides(3, ONE_ITEM_A, ONE_ITEM_F)
    _, ffn = _sides(4, ONE_ITEM_A, ONE_ITEM_F)
    got = breakdown(attention, ffn)
    assert got["wire out"] is got["wire back"] is got["wire out + back"] is got["sum"] is None
    assert got["pack"] == pytest.approx(0.4) and got["FFN compute"] == pytest.approx(4.0)  # one side's own spans
    assert got["round trip"] == pytest.approx(9.0) and got["items"] == {"attention": 3, "ffn": 4}


def test_two_hosts_give_the_wire_both_ways_only_and_no_ffn_side_gives_the_attention_spans() -> None:
    attention, ffn = _sides(2, ONE_ITEM_A, ONE_ITEM_F)
    apart = breakdown(attention, ffn, one_host=False)
    assert apart["wire out"] is apart["wire back"] is apart["sum"] is None
    assert apart["wire out + back"] == pytest.approx(2.8) and apart["FFN wake-up"] == pytest.approx(0.5)
    alone = breakdown(attention, None)
    assert [alone[name] is None for name in NINE] == [False, False, True, True, True, True, True, False, False]
    assert alone["items"] == {"attention": 2, "ffn": None} and alone["wire out + back"] is None
    empty = breakdown(AttentionStamps().as_dict(), None)
    assert all(empty[name] is None for name in (*NINE, "round trip", "sends"))


# ------------------------------------------------------------------------------------ a real round trip

HIDDEN, TOP_K, EXPERTS, TOKENS = 32, 2, 2, 8
COMPUTE_S = 0.002  # the FFN compute of every item: its span must hold it


@pytest.fixture
def links() -> Iterator[tuple[PeerLink, PeerLink]]:
    """(the Attention rank's link, the FFN rank's link) of 1A1F on one zmq loopback pair."""
    with channel_links(Topology(1, 1, EXPERTS), "zmq") as links:
        yield links


def _slots() -> tuple[BufferSlot, BufferSlot, threading.Event]:
    return BufferSlot(INPUT, 0, None, None), BufferSlot(OUTPUT, 0, None, None), threading.Event()  # type: ignore[arg-type]


def _serve(side: FfnSide, items: int, failed: list[BaseException]) -> None:
    """The FFN rank: ``items`` items, each computed as 2 x its rows after ``COMPUTE_S`` (ids and weights unread)."""

    def compute(item: WorkItem, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE_S)
        return hidden * 2

    inputs, outputs, cancel = _slots()
    try:
        for seq in range(items):
            work = Work(WorkItem(0, 0, seq), inputs, outputs, cancel)
            side.on_recv(work)
            side.on_compute(work, compute)
            side.on_send(work)
            side.on_cleanup(work)
    except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread
        failed.append(exc)


def _round_trips(side: RoundTripAttentionSide, routed: Any, results: list[Any], items: int) -> list[int]:
    """``items`` round trips as the vLLM path makes them (the result waited for after on_send); each one's
    time from before ``on_compute`` to after the wait (ns)."""
    inputs, outputs, cancel = _slots()
    times = []
    for seq in range(items):
        work = Work(WorkItem(0, 0, seq), inputs, outputs, cancel)
        side.on_recv(work)
        start = time.perf_counter_ns()
        side.on_compute(work, lambda item, value: value)
        side.on_send(work)
        combined = results.pop().wait()
        times.append(time.perf_counter_ns() - start)
        side.on_cleanup(work)
        assert torch.equal(combined, routed[0] * 2)  # one FFN rank: each row comes back once, doubled
    return times


def _run(links: tuple[PeerLink, PeerLink], tokens: int, items: int) -> tuple[dict[str, Any], list[int]]:
    attention_link, ffn_link = links
    shape, options = P2pShape(HIDDEN, TOP_K, EXPERTS, 1, 16), parse_options({"recv_timeout_s": 10.0})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, EXPERTS, (tokens, TOP_K), generator=gen)
    routed = (torch.randn(tokens, HIDDEN, generator=gen), ids, torch.rand(tokens, TOP_K, generator=gen))
    results: list[Any] = []

    class Sink(InFlightSink):
        def __call__(self, item: WorkItem, result: Any) -> None:
            results.append(result)

    attention = RoundTripAttentionSide(attention_link, shape, options, source=lambda item: routed, sink=Sink())
    ffn = FfnSide(ffn_link, shape, options)
    failed: list[BaseException] = []
    server = threading.Thread(target=_serve, args=(ffn, items, failed), daemon=True)
    server.start()
    times = _round_trips(attention, routed, results, items)
    server.join(10)
    assert not server.is_alive() and not failed, failed
    return breakdown(attention.stamps.as_dict(), ffn.stamps.as_dict()), times


def test_a_real_round_trip_is_split_into_nine_spans_that_add_up_to_it(
    links: tuple[PeerLink, PeerLink], one_torch_thread: None
) -> None:
    got, times = _run(links, TOKENS, items=20)
    assert got["items"] == {"attention": 20, "ffn": 20}
    assert all(got[name] >= 0 for name in NINE), got
    assert got["FFN compute"] >= COMPUTE_S * 1e6, got  # the compute's sleep is in its span, not beside it
    measured = sum(times) / len(times) / 1e3
    assert got["sum"] == pytest.approx(got["round trip"], abs=0.01)  # the spans meet end to start
    assert got["sum"] == pytest.approx(measured, rel=0.05), (got, measured)
    assert got["wire out + back"] == pytest.approx(got["wire out"] + got["wire back"], abs=0.01)
    assert got["sends"] >= 0, got  # the Attention side's sends done: overlaps the wire, may end after the read


def test_an_item_with_no_row_has_no_ffn_compute(links: tuple[PeerLink, PeerLink], one_torch_thread: None) -> None:
    got, _ = _run(links, 0, items=3)
    assert got["items"] == {"attention": 3, "ffn": 3}
    assert got["FFN compute"] == 0.0 and all(got[name] >= 0 for name in NINE), got
