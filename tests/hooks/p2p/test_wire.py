"""torch_p2p's wire format and options: headers validated field by field, layouts that round-trip."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from afd_mrv2.errors import ConfigError
from afd_mrv2.hooks.p2p import ProtocolError, parse_options, wire
from afd_mrv2.items import WorkItem

EXPECTED = wire.Header(kind=wire.KIND_DISPATCH, src=1, dst=4, layer=2, stage=1, stages=2, seq=17, tokens=5)


def roundtrip(header: wire.Header) -> wire.Header:
    words = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
    header.write(words)
    return wire.Header.read(words)


def test_header_roundtrip() -> None:
    assert roundtrip(EXPECTED) == EXPECTED
    wire.validate_header(roundtrip(EXPECTED), EXPECTED, peer_name="attention rank 1 (global rank 1)", what="dispatch")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("magic", 0x1234, "expected 0x41464432"),
        ("kind", wire.KIND_COMBINE, "expected dispatch, got combine"),
        ("src", 0, "expected 1, got 0"),
        ("dst", 3, "expected 4, got 3"),
        ("layer", 7, "expected 2, got 7"),
        ("stage", 0, "sent layer=2 stage 0 of 2 (seq=17), but the receiver expects layer=2 stage 1 of 2"),
        ("stages", 3, "sent layer=2 stage 1 of 3 (seq=17), but the receiver expects layer=2 stage 1 of 2"),
        ("seq", 18, "expected 17, got 18"),
        ("tokens", 6, "expected 5, got 6"),
    ],
)
def test_each_bad_field_is_named(field: str, value: int, needle: str) -> None:
    bad = dataclasses.replace(EXPECTED, **{field: value})
    with pytest.raises(ProtocolError) as info:
        wire.validate_header(roundtrip(bad), EXPECTED, peer_name="attention rank 1 (global rank 1)", what="dispatch")
    err = info.value
    assert err.field == field and err.peer == 1
    assert f"field {field!r}" in str(err) and needle in str(err)
    assert "malformed dispatch header from attention rank 1 (global rank 1)" in str(err)


def test_token_count_is_range_checked_when_learned_from_the_header() -> None:
    ok = dataclasses.replace(EXPECTED, tokens=64)
    wire.validate_header(ok, EXPECTED, peer_name="p", what="dispatch", max_tokens=64)
    with pytest.raises(ProtocolError, match=r"expected 0\.\.64 \(the per-stage capacity\), got 65"):
        wire.validate_header(
            dataclasses.replace(EXPECTED, tokens=65), EXPECTED, peer_name="p", what="dispatch", max_tokens=64
        )
    with pytest.raises(ProtocolError, match="got -1"):
        wire.validate_header(
            dataclasses.replace(EXPECTED, tokens=-1), EXPECTED, peer_name="p", what="dispatch", max_tokens=64
        )


def test_dispatch_layout_round_trips_rows() -> None:
    layout = wire.DispatchLayout(hidden_size=6, top_k=2)
    buffer = torch.empty(layout.nbytes(8), dtype=torch.uint8)
    hidden, weights, ids = layout.views(buffer, 3)
    hidden.copy_(torch.arange(18.0).view(3, 6))
    weights.copy_(torch.tensor([[0.5, 0.25], [0.1, 0.2], [1.0, 0.0]]))
    ids.copy_(torch.tensor([[0, 3], [2, 1], [7, 5]]))
    again = layout.views(buffer.clone(), 3)
    assert torch.equal(again[0], hidden) and torch.equal(again[1], weights) and torch.equal(again[2], ids)
    assert layout.row_bytes == 4 * (6 + 4)


def test_combine_message_and_control_text() -> None:
    message = torch.zeros(wire.combine_nbytes(4, 2), dtype=torch.uint8)
    wire.combine_rows(message, 4, 2).copy_(torch.ones(2, 4))
    assert wire.combine_rows(message, 4, 2).sum() == 8
    control = torch.zeros(wire.CONTROL_BYTES, dtype=torch.uint8)
    wire.encode_control(control, dataclasses.replace(EXPECTED, kind=wire.KIND_ABORT), "FFN rank 0 died: ü" + "x" * 1000)
    text = wire.decode_control_text(control)
    assert text.startswith("FFN rank 0 died: ü") and len(text.encode()) < wire.CONTROL_TEXT_BYTES
    assert wire.Header.read(wire.header_view(control)).kind == wire.KIND_ABORT


def test_options() -> None:
    opts = parse_options({})
    assert opts.recv_timeout_s == 30 and opts.send_timeout_s == 30 and opts.link is None
    opts = parse_options({"recv_timeout_s": 2, "sim_latency_us": 500, "sim_bandwidth_gbps": 1})
    assert opts.send_timeout_s == 2 and opts.link is not None
    assert opts.link.cost_s("send", 1000) == pytest.approx(500e-6 + 1e-6)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"recv_timeout": 1}, "recv_timeout"),
        ({"recv_timeout_s": 0}, "recv_timeout_s"),
        ({"send_timeout_s": "fast"}, "send_timeout_s"),
        ({"sim_latency_us": -1}, "sim_latency_us"),
        ({"sim_bandwidth_gbps": True}, "sim_bandwidth_gbps"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_options_name_the_key(extra: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_options(extra)
    assert info.value.key == f"afd.connector_extra_config.{key}"


def test_the_header_carries_the_stage_count_of_the_items_step() -> None:
    item = WorkItem(3, 1, 9, num_stages=2)
    header = wire.item_header(wire.KIND_DISPATCH, 0, 2, item, tokens=4)
    assert (header.layer, header.stage, header.stages, header.seq) == (3, 1, 2, 9)
    assert roundtrip(header) == header and wire.HEADER_WORDS == 9 and wire.VERSION == 2
    with pytest.raises(ValueError, match="claims stage 1 of 1"):
        wire.item_header(wire.KIND_DISPATCH, 0, 2, WorkItem(3, 1, 9), tokens=4)


@pytest.mark.parametrize(
    ("sent", "expected", "identities"),
    [
        # one rank split the step in two stages, the other ran it unsplit
        (WorkItem(0, 0, 0, num_stages=2), WorkItem(0, 0, 0, num_stages=1), ("stage 0 of 2", "stage 0 of 1")),
        # both split it, but the stages went out in another order
        (WorkItem(0, 1, 0, num_stages=2), WorkItem(0, 0, 0, num_stages=2), ("stage 1 of 2", "stage 0 of 2")),
    ],
)
def test_a_stage_identity_mismatch_names_both_ranks_and_both_identities(
    sent: WorkItem, expected: WorkItem, identities: tuple[str, str]
) -> None:
    got = wire.item_header(wire.KIND_DISPATCH, 0, 2, sent, tokens=3)
    want = wire.item_header(wire.KIND_DISPATCH, 0, 2, expected, tokens=0)
    with pytest.raises(ProtocolError) as info:
        wire.validate_header(
            roundtrip(got),
            want,
            peer_name="attention rank 0 (global rank 0)",
            what="dispatch",
            max_tokens=8,
            me="FFN rank 0 (global rank 2)",
        )
    text = str(info.value)
    assert info.value.field in wire.STAGE_FIELDS and info.value.peer == 0
    assert f"attention rank 0 (global rank 0) sent layer=0 {identities[0]}" in text
    assert f"FFN rank 0 (global rank 2) expects layer=0 {identities[1]}" in text


def test_a_header_writes_the_same_words_into_a_host_buffer_and_into_any_other_tensor() -> None:
    """The host path (one struct.pack_into) and the torch path (a strided view) write identical words."""
    header = wire.Header(kind=wire.KIND_COMBINE, src=3, dst=-1, layer=7, stage=1, stages=2, seq=2**40, tokens=17)
    host = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
    header.write(host)
    strided = torch.zeros(2 * wire.HEADER_WORDS, dtype=torch.int64)[::2]  # not contiguous: the torch path
    header.write(strided)
    assert host.tolist() == strided.tolist() == [getattr(header, f) for f in wire.FIELDS]
    assert wire.Header.read(host) == header


NAMES = {1: "attention rank 1 (global rank 1)", 4: "FFN rank 0 (global rank 4)"}


def _raised(call: Callable[[], None]) -> tuple[str, str, int]:
    with pytest.raises(ProtocolError) as info:
        call()
    return str(info.value), info.value.field, info.value.peer


@pytest.mark.parametrize("max_tokens", [None, 8])
@pytest.mark.parametrize("field", wire.FIELDS)
def test_header_words_fail_as_the_header_check_does(field: str, max_tokens: int | None) -> None:
    """check_words (the hooks' tuple compare) raises exactly validate_header's error, naming src and dst."""
    bad = dataclasses.replace(EXPECTED, **{field: EXPECTED.words[wire.FIELDS.index(field)] + 100})
    named: list[int] = []

    def describe(rank: int) -> str:
        named.append(rank)
        return NAMES[rank]

    got = _raised(
        lambda: wire.check_words(bad.words, EXPECTED.words, what="dispatch", describe=describe, max_tokens=max_tokens)
    )
    want = _raised(
        lambda: wire.validate_header(
            bad, EXPECTED, peer_name=NAMES[1], what="dispatch", max_tokens=max_tokens, me=NAMES[4]
        )
    )
    assert got == want and sorted(named) == [1, 4]


def test_matching_header_words_pass_without_naming_anyone() -> None:
    def describe(rank: int) -> str:
        raise AssertionError(f"named rank {rank} for a header that matches")

    wire.check_words(EXPECTED.words, EXPECTED.words, what="combine", describe=describe)
    fewer = dataclasses.replace(EXPECTED, tokens=3).words  # a count learned from the header: in range
    wire.check_words(fewer, EXPECTED.words, what="dispatch", describe=describe, max_tokens=5)
    with pytest.raises(ProtocolError, match=r"field 'tokens' expected 5, got 3"):
        wire.check_words(fewer, EXPECTED.words, what="dispatch", describe=NAMES.__getitem__)


def test_item_words_are_the_item_headers_words_and_check_its_stage() -> None:
    item = WorkItem(3, 1, 9, num_stages=2)
    assert wire.item_words(wire.KIND_COMBINE, 4, 1, item, 6) == wire.item_header(wire.KIND_COMBINE, 4, 1, item, 6).words
    renumbered = wire.Header.from_words(wire.item_words(wire.KIND_COMBINE, 4, 1, item, 6, seq=40))
    assert renumbered == dataclasses.replace(wire.item_header(wire.KIND_COMBINE, 4, 1, item, 6), seq=40)
    with pytest.raises(ValueError, match="claims stage 1 of 1"):
        wire.item_words(wire.KIND_DISPATCH, 0, 2, WorkItem(3, 1, 9), 4)


def test_host_bytes_of_one_tensor_is_one_view_that_writes_it() -> None:
    tensor = torch.zeros(4, dtype=torch.int64)
    view = wire.host_bytes(tensor)
    assert wire.host_bytes(tensor) is view and wire.host_bytes(tensor[:4]) is view
    view.cast("q")[2] = -7
    assert tensor.tolist() == [0, 0, -7, 0]
    assert len(wire.host_bytes(tensor[:2])) == 16  # another size of the same memory: its own view
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        wire.host_bytes(torch.zeros(4, 2).t())
