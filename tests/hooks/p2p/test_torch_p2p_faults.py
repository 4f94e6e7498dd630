"""torch_p2p against a rogue or failing peer: a clear error naming the peer, in bounded time.

Each test starts two processes on loopback (tests/hooks/p2p/p2p_peer.py): the real
connector on one side, a misbehaving peer on the other.
"""

from __future__ import annotations

import json
import sys

import pytest

from afd_mrv2.procs import free_port
from tests.procs import Proc, running

PEER = str(__import__("pathlib").Path(__file__).with_name("p2p_peer.py"))


def scenario(name: str, real_rank: int, timeout_s: float = 30.0) -> tuple[dict, Proc]:
    port = str(free_port())
    procs = [Proc([sys.executable, PEER, name, str(rank), port]) for rank in (0, 1)]
    with running(*procs):
        codes = [p.wait(timeout_s) for p in procs]
    real = procs[real_rank]
    assert codes[real_rank] == 3, f"exit {codes}; stdout={real.stdout!r} stderr={real.stderr[-2000:]!r}"
    return json.loads(real.out[-1]), real


@pytest.mark.parametrize(
    ("field", "needle"),
    [("layer", "expected 0, got 7"), ("tokens", "expected 0..4 (the per-stage capacity), got 5"), ("magic", "0xbad")],
)
def test_malformed_dispatch_header_is_a_clear_error(field: str, needle: str) -> None:
    outcome, _ = scenario(f"bad-dispatch-{field}", real_rank=1)
    assert outcome["error_type"] == "PipelineError" and outcome["cause_type"] == "ProtocolError"
    assert outcome["field"] == field and outcome["peer"] == 0
    assert "on_recv failed for work item layer=0 stage=0 seq=0" in outcome["error"]
    assert "malformed dispatch header from attention rank 0 (global rank 0)" in outcome["error"]
    assert f"field {field!r}" in outcome["error"] and needle in outcome["error"]
    assert outcome["elapsed_s"] < 10


def test_malformed_combine_header_is_a_clear_error() -> None:
    outcome, _ = scenario("bad-combine-seq", real_rank=0)
    assert outcome["cause_type"] == "ProtocolError" and outcome["field"] == "seq" and outcome["peer"] == 1
    assert (
        "malformed combine header from FFN rank 0 (global rank 1): field 'seq' expected 0, got 99" in outcome["error"]
    )


@pytest.mark.parametrize(
    ("name", "sent", "expected", "field"),
    [
        ("stages-2-vs-1", "stage 0 of 2", "stage 0 of 1", "stages"),  # one rank split the step, the other did not
        ("stages-swapped", "stage 1 of 2", "stage 0 of 2", "stage"),  # both split, stages issued in another order
    ],
)
def test_a_stage_identity_mismatch_fails_naming_both_ranks_and_both_stages(
    name: str, sent: str, expected: str, field: str
) -> None:
    """Both sides run the real connector; the FFN rank's header check catches the mismatch on the first item."""
    outcome, _ = scenario(name, real_rank=1)
    assert outcome["cause_type"] == "ProtocolError" and outcome["field"] == field and outcome["peer"] == 0
    error = outcome["error"]
    assert "on_recv failed for work item layer=0 stage=0 seq=0" in error
    assert f"stage identity mismatch: attention rank 0 (global rank 0) sent layer=0 {sent} (seq=0)" in error
    assert f"but FFN rank 0 (global rank 1) expects layer=0 {expected} (seq=0)" in error


def test_silent_peer_fails_at_the_configured_deadline() -> None:
    outcome, _ = scenario("silent-attention", real_rank=1)
    assert outcome["cause_type"] == "PeerTimeout" and outcome["peer"] == 0
    assert (
        "attention rank 0 (global rank 0) is connected but sent no dispatch header within 1 s (recv_timeout_s)"
        in (outcome["error"])
    )
    assert 0.9 <= outcome["elapsed_s"] <= 3.0


def test_dead_peer_is_named_at_once() -> None:
    outcome, _ = scenario("dead-attention", real_rank=1)
    assert outcome["cause_type"] == "PeerLost" and outcome["peer"] == 0
    assert "lost attention rank 0 (global rank 0)" in outcome["error"]
    assert outcome["elapsed_s"] < 5


def test_concurrent_send_and_receive_threads_on_one_gloo_group() -> None:
    """What multistream does on gloo: the recv and send streams post and wait at the same time."""
    port = str(free_port())
    procs = [Proc([sys.executable, PEER, "concurrent", str(rank), port]) for rank in (0, 1)]
    with running(*procs):
        codes = [p.wait(60) for p in procs]
    for proc, code in zip(procs, codes, strict=True):
        assert code == 0, proc.stderr[-2000:]
        assert json.loads(proc.out[-1])["ok"] is True


def test_close_cancels_a_blocked_receive() -> None:
    """The receive honours work.cancelled: close() returns promptly and leaves no stream thread behind."""
    outcome, _ = scenario("cancel", real_rank=1)
    assert outcome["close_s"] < 1.5
    assert outcome["abandoned"] == ["layer=0 stage=0 seq=0"]
    assert outcome["abandoned_streams"] == {}
