"""The live figures' records and codec (:mod:`afd_mrv2.live_stats`): what each role builds, the document its
publisher hands the rendezvous store (the keys serve read before the records, plus ``schema``), what the codec
refuses, naming the key, and the publisher's thread."""

from __future__ import annotations

import json
import threading
import time
import warnings
from dataclasses import replace
from typing import Any

import pytest

from afd_mrv2.live_stats import (
    SCHEMA_KEY,
    SCHEMA_VERSION,
    AttentionFigures,
    FailoverFigures,
    FfnFigures,
    FiguresError,
    FiguresPublisher,
    Histogram,
    LostRank,
    MemoryFigures,
    Written,
    decode,
    encode,
)

#: The keys serve's /metrics and /afd/status read before the records (the documents' keys then).
#: Schema 2 added ``memory``.
ATTENTION_KEYS = {"calls", "tokens", "round_trip_seconds", "round_trip_total_s", "hidden_total_s", "failover", "memory"}
FFN_KEYS = {"items", "redispatched", "computed", "tokens", "busy_s", "up_s", "memory", "ranks_per_call"}
FAILOVER_KEYS = {"failovers", "lost", "first_resend_at", "resent_items", "resent_rows", "rejoins", "rejoined_at"}


MEMORY = MemoryFigures(
    read_bytes={"routed_experts": 0, "other": 1_000},
    resident_bytes={"routed_experts": 0, "other": 900},
    peak_rss_bytes=4_096_000,
)


def attention_figures(failover: FailoverFigures | None = None, memory: MemoryFigures | None = None) -> AttentionFigures:
    hist = Histogram()
    for seconds in (0.0007, 0.02, 20.0):  # the last above every bound: counted, in no bucket
        hist.observe(seconds)
    return AttentionFigures(
        calls=6,
        tokens=48,
        round_trip_seconds=hist.figures(),
        round_trip_total_s=0.75,
        hidden_total_s=0.25,
        failover=failover,
        memory=memory,
    )


def failover_figures() -> FailoverFigures:
    return FailoverFigures(
        failovers=1,
        lost={2: LostRank(at=100.125, reason="peer closed")},
        first_resend_at={2: 100.25},
        resent_items=4,
        resent_rows=9,
        rejoins=1,
        rejoined_at={2: 130.5},
    )


FFN = FfnFigures(items=10, computed=8, tokens=70, busy_s=0.5, redispatched=2, up_s=2.0, memory=None)
FFN_MEMORY = replace(FFN, memory=replace(MEMORY, read_bytes={"routed_experts": 6_000, "other": 0}))


@pytest.mark.parametrize(
    ("role", "figures"),
    [
        ("attention", attention_figures()),
        ("attention", attention_figures(failover_figures(), MEMORY)),
        ("ffn", FFN),
        ("ffn", FFN_MEMORY),
    ],
)
def test_a_record_survives_the_codec_and_json_and_keeps_the_keys_serve_read(role: str, figures: Any) -> None:
    written = Written(figures=figures, at=1700000000.123, pid=42)
    doc = json.loads(json.dumps(encode(written), sort_keys=True))
    assert decode(role, doc) == written
    assert doc[SCHEMA_KEY] == SCHEMA_VERSION and doc["at"] == 1700000000.123 and doc["pid"] == 42
    assert set(doc) - {SCHEMA_KEY, "at", "pid"} == (ATTENTION_KEYS if role == "attention" else FFN_KEYS)
    if role == "attention" and figures.failover is not None:
        assert set(doc["failover"]) == FAILOVER_KEYS and doc["failover"]["lost"] == {
            "2": {"at": 100.125, "reason": "peer closed"}
        }
        assert doc["round_trip_seconds"]["counts"][:3] == [0, 1, 1] and doc["round_trip_seconds"]["count"] == 3
    if figures.memory is None:
        assert doc["memory"] is None
    else:
        assert doc["memory"] == {
            "read_bytes": dict(sorted(figures.memory.read_bytes.items())),
            "resident_bytes": dict(sorted(figures.memory.resident_bytes.items())),
            "peak_rss_bytes": 4_096_000,
        }


def test_derived_fractions_are_the_shares_serve_shows() -> None:
    assert attention_figures().hidden_fraction == pytest.approx(1 / 3)
    assert attention_figures().failovers == 0 and attention_figures().resent_items == 0
    with_failover = attention_figures(failover_figures())
    assert with_failover.failovers == 1 and with_failover.resent_items == 4
    assert FFN.busy_fraction == 0.25
    idle = FfnFigures(items=0, computed=0, tokens=0, busy_s=0.0, redispatched=0, up_s=0.0, memory=None)
    assert idle.busy_fraction == 0.0  # nothing measured yet: 0, never a division by zero


def ffn_doc(**change: Any) -> dict[str, Any]:
    doc = encode(Written(figures=FFN_MEMORY, at=1.0, pid=7))
    doc.update(change)
    return doc


def memory_doc(**change: Any) -> dict[str, Any]:
    return ffn_doc(memory={**MEMORY.as_dict(), **change})


@pytest.mark.parametrize(
    ("role", "doc", "says"),
    [
        ("ffn", {k: v for k, v in ffn_doc().items() if k != "busy_s"}, "ffn-0.json: missing ['busy_s']"),
        ("ffn", ffn_doc(busy=1.0), "ffn-0.json: unknown ['busy']; accepted: ['busy_s', 'computed'"),
        ("ffn", ffn_doc(schema=1), "ffn-0.json.schema: 1, accepted: 2"),  # schema 1 had no memory
        ("ffn", {k: v for k, v in ffn_doc().items() if k != SCHEMA_KEY}, "ffn-0.json.schema: None, accepted: 2"),
        ("ffn", {k: v for k, v in ffn_doc().items() if k != "memory"}, "ffn-0.json: missing ['memory']"),
        ("ffn", {k: v for k, v in ffn_doc().items() if k != "pid"}, "ffn-0.json: missing ['pid']"),
        ("ffn", ffn_doc(items=True), "ffn-0.json.items: expected an integer, got True"),
        ("ffn", ffn_doc(busy_s="0.5"), "ffn-0.json.busy_s: expected a number, got '0.5'"),
        ("ffn", [1, 2], "ffn-0.json: expected an object, got list"),
        ("ffn", ffn_doc(memory=[]), "ffn-0.json.memory: expected an object, got list"),
        ("ffn", ffn_doc(memory={"read_bytes": {}}), "ffn-0.json.memory: missing ['resident_bytes', 'peak_rss_bytes']"),
        ("ffn", memory_doc(peak_rss_bytes=1.5), "ffn-0.json.memory.peak_rss_bytes: expected an integer, got 1.5"),
        ("ffn", memory_doc(read_bytes=7), "ffn-0.json.memory.read_bytes: expected an object of kind -> bytes, got int"),
        (
            "ffn",
            memory_doc(read_bytes={"routed_experts": 1}),
            "ffn-0.json.memory.read_bytes: kinds ['routed_experts'], accepted: ['other', 'routed_experts']",
        ),
        (
            "ffn",
            memory_doc(resident_bytes={"routed_experts": 1, "other": 2, "kv": 3}),
            "ffn-0.json.memory.resident_bytes: kinds ['kv', 'other', 'routed_experts'], accepted:",
        ),
        (
            "ffn",
            memory_doc(resident_bytes={"routed_experts": "1", "other": 2}),
            "ffn-0.json.memory.resident_bytes.routed_experts: expected an integer, got '1'",
        ),
        ("router", ffn_doc(), "ffn-0.json: no live figures for role 'router'; accepted: ['attention', 'ffn']"),
    ],
)
def test_the_codec_refuses_a_document_naming_the_key(role: str, doc: Any, says: str) -> None:
    with pytest.raises(FiguresError) as caught:
        decode(role, doc, where="ffn-0.json")
    assert says in str(caught.value)


def test_the_codec_refuses_nested_keys_by_their_path() -> None:
    doc = encode(Written(figures=attention_figures(failover_figures()), at=1.0, pid=7))
    bad = json.loads(json.dumps(doc))
    bad["failover"]["lost"]["2"]["why"] = "x"
    with pytest.raises(FiguresError, match=r"^attention-0.json.failover.lost.2: unknown \['why'\]; accepted"):
        decode("attention", bad, where="attention-0.json")
    bad = json.loads(json.dumps(doc))
    bad["round_trip_seconds"]["counts"].pop()
    with pytest.raises(FiguresError, match=r"round_trip_seconds.counts: 12 counts for 13 buckets"):
        decode("attention", bad)
    bad = json.loads(json.dumps(doc))
    bad["failover"]["first_resend_at"] = {"two": 1.0}
    with pytest.raises(FiguresError, match=r"failover.first_resend_at: key 'two' is not an FFN rank"):
        decode("attention", bad)


def test_a_failover_log_document_is_the_failover_record() -> None:
    """The Attention side builds its record's ``failover`` from the connector's FailoverLog.as_dict()."""
    from afd_mrv2.hooks.p2p.errors import PeerError
    from afd_mrv2.hooks.p2p.failover import FailoverLog

    log = FailoverLog()
    log.lost(
        1,
        PeerError("FFN rank 1 closed\nmore", peer=2, peer_name="FFN rank 1"),
        moved=[4, 5],
        live=frozenset({0}),
        me="attention 0",
    )
    log.resent(1, rows=6)
    log.rejoined(1, "a0.1-f1.2", me="attention 0")
    figures = FailoverFigures.from_dict(log.as_dict(), "failover")
    assert figures.failovers == 1 and figures.resent_rows == 6 and figures.lost[1].reason == "FFN rank 1 closed"
    assert figures.as_dict() == log.as_dict()


@pytest.fixture
def afd_load(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A function recording an ``afd`` load in this process (:mod:`afd_mrv2.mrv2.memory`, restored after the
    test): the loader's counted read of two tensors, then the resident parameters (vLLM's routed-experts
    layer class, which the real count needs, is not here: the count is given)."""
    import torch

    from afd_mrv2.mrv2 import memory

    monkeypatch.setattr(memory, "_load", None)
    monkeypatch.setattr(memory, "parameter_bytes", lambda model: {"routed_experts": 256, "other": 64})

    def load() -> None:
        weights = [
            ("model.layers.0.mlp.experts.3.w1.weight", torch.zeros(8, 8, dtype=torch.bfloat16)),  # 128 bytes
            ("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4)),  # 64 bytes
        ]
        assert [name for name, _ in memory.count_read(weights)] == [name for name, _ in weights]
        memory.record_load(torch.nn.Linear(1, 1))

    return load


def check_memory(figures: MemoryFigures | None) -> None:
    """``figures`` are what :func:`afd_load` recorded, with this process's peak RSS."""
    from afd_mrv2.procs import peak_rss_bytes

    assert figures is not None
    assert figures.read_bytes == {"routed_experts": 128, "other": 64}
    assert figures.resident_bytes == {"routed_experts": 256, "other": 64}
    assert 0 < figures.peak_rss_bytes <= peak_rss_bytes()


def test_the_attention_side_builds_its_record_from_what_it_measured(afd_load: Any) -> None:
    """An engine's record is what it measured; it publishes it in the store once its link's opening reached
    the store (nothing before)."""
    import torch.distributed as dist

    from afd_mrv2.config import parse_afd_config
    from afd_mrv2.mrv2.attention.remote import RemoteExperts
    from afd_mrv2.mrv2.transport.store import RendezvousStore

    section = {"connector": "torch_p2p", "port": 29500, "compute_gate_on_attention": True, "role": "attention"}
    experts = RemoteExperts(parse_afd_config(section), max_tokens=16)
    experts.meter.round_trip(0, 0, 1_000_000)  # micro-batch 0's round trip: 1 ms ...
    experts.meter.compute(1, 200_000, 600_000)  # ... of which 0.4 ms under micro-batch 1's compute
    experts.meter.end_step(2)
    experts.round_trips.observe(0.001)
    experts.tokens[8] += 2
    figures = experts.live_stats()
    assert figures.calls == 2 and figures.tokens == 16 and figures.failover is None
    assert figures.memory is None  # no afd load in this process
    assert figures.round_trip_total_s == pytest.approx(0.001) and figures.hidden_fraction == pytest.approx(0.4)
    assert figures.round_trip_seconds.count == 1 and figures.round_trip_seconds.counts[1] == 1  # le 0.001
    experts._live.publish_now()  # no store reached yet: nothing to publish to, nothing raised

    class Reached:  # an opening that reached the store (AttentionLinkOpening.store)
        store = RendezvousStore(dist.HashStore())

    experts._opening = Reached()  # type: ignore[assignment]
    experts._live.publish_now()
    doc = Reached.store.live("attention", 0)
    assert doc is not None and decode("attention", doc).figures == figures
    afd_load()
    figures = experts.live_stats()
    check_memory(figures.memory)
    experts._live.publish_now()
    doc = Reached.store.live("attention", 0)
    assert doc is not None and decode("attention", doc).figures == figures
    experts._live.stop()


def test_the_ffn_record_is_what_the_servers_old_dict_said(afd_load: Any) -> None:
    """``FfnReport.figures`` gives the record serve_ffn's closure built as a dict from ``live()`` plus its
    ``redispatched`` and ``up_s``, and what the rank's ``afd`` load read and holds."""
    from afd_mrv2.items import WorkItem
    from afd_mrv2.mrv2.ffn.report import FfnReport

    report = FfnReport(moe_layers=2)
    for stages in (1, 2, 2):
        report.item_seen(WorkItem(0, 0, 0, num_stages=stages))
    report.record(tokens=5, seconds=0.25)
    report.record(tokens=3, seconds=0.125)
    figures = report.figures(redispatched=1, up_s=3.5)
    assert figures == FfnFigures(items=3, computed=2, tokens=8, busy_s=0.375, redispatched=1, up_s=3.5, memory=None)
    afd_load()
    check_memory(report.figures(redispatched=1, up_s=3.5).memory)


def test_a_publisher_building_a_dict_still_publishes_the_record_with_a_deprecation() -> None:
    old = {k: v for k, v in FFN.as_dict().items() if k != "memory"}  # a schema-1 builder's dict
    got: list[Written] = []
    publisher = FiguresPublisher("ffn", got.append, lambda: old)
    with pytest.warns(DeprecationWarning, match="return an AttentionFigures or FfnFigures"):
        publisher.publish_now()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        publisher.publish_now()  # warned once per publisher, not at every publish
    assert [w.figures for w in got] == [FFN, FFN] and publisher.published == 2
    bad = FiguresPublisher("ffn", got.append, lambda: {**old, "busy": 1})
    with pytest.warns(DeprecationWarning), pytest.raises(FiguresError, match=r"ffn: unknown \['busy'\]"):
        bad.publish_now()
    with pytest.raises(FiguresError, match="no live figures for role 'proxy'"):
        FiguresPublisher("proxy", got.append, lambda: FFN)


def test_a_publisher_publishes_every_period_off_the_callers_thread_and_drops_a_failed_publish() -> None:
    """After a burst nothing calls it: its own thread still publishes the latest figures within ``every_s``;
    a publish that raises (the store cut off) is dropped and the next period tries again; a nudge publishes at
    once; stop publishes a last time, and then no more."""
    figures = {"now": FfnFigures(items=1, computed=1, tokens=2, busy_s=0.5, redispatched=0, up_s=1.0, memory=None)}
    got: list[tuple[str, Written]] = []
    failing = {"on": True}

    def publish(written: Written) -> None:
        if failing["on"]:
            raise RuntimeError("the store did not answer")
        got.append((threading.current_thread().name, written))

    publisher = FiguresPublisher("ffn", publish, lambda: figures["now"], every_s=0.2)

    def publishers() -> int:
        return [t.name for t in threading.enumerate()].count("afd-live-stats")

    before = publishers()  # another test's engine may have one running
    publisher.start()
    publisher.start()  # once: a second call starts no second thread
    assert publishers() == before + 1
    time.sleep(0.5)
    assert got == [] and publisher.published == 0  # failed, dropped, still running
    failing["on"] = False
    figures["now"] = FfnFigures(items=7, computed=7, tokens=9, busy_s=1.5, redispatched=0, up_s=2.0, memory=None)
    deadline = time.monotonic() + 10
    while not got or got[-1][1].figures.items != 7:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the publisher never published the latest figures"
        time.sleep(0.02)
    assert {name for name, _ in got} == {"afd-live-stats"}
    publisher.every_s = 60.0
    time.sleep(0.3)  # the period in progress ends; the next is a minute
    count = len(got)
    publisher.nudge()
    deadline = time.monotonic() + 5
    while len(got) == count:
        assert time.monotonic() < deadline, "a nudge did not publish"
        time.sleep(0.01)
    figures["now"] = replace(figures["now"], items=9)
    publisher.stop()
    assert got[-1][1].figures.items == 9  # type: ignore[union-attr]
    assert publishers() == before
    count = len(got)
    time.sleep(0.3)
    assert len(got) == count
