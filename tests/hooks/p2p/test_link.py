"""PeerLink naming the root cause, with a process group whose operations complete when the test says.

The fake group stands in for gloo's ``ProcessGroup.send/recv``: each call returns a work
object whose ``wait()`` blocks until the test completes it (filling a receive buffer) or
fails it (``RuntimeError``, as gloo's "Connection closed by peer").
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.errors import PeerAborted, PeerLost
from afd_mrv2.hooks.p2p.link import Pair, PeerLink
from afd_mrv2.topology import Topology


class _Work:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def complete(self, payload: torch.Tensor | None = None) -> None:
        if payload is not None:
            self.tensor[: payload.numel()].copy_(payload)
        self._done.set()

    def fail(self, text: str) -> None:
        self._error = RuntimeError(text)
        self._done.set()


class _Group:
    def __init__(self) -> None:
        self.recvs: dict[tuple[int, int], _Work] = {}

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        work = self.recvs[(src, tag)] = _Work(tensors[0])
        return work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        work = _Work(tensors[0])
        work.complete()
        return work


def _abort_message(src: int, dst: int, text: str) -> torch.Tensor:
    buffer = torch.zeros(wire.CONTROL_BYTES, dtype=torch.uint8)
    header = wire.Header(kind=wire.KIND_ABORT, src=src, dst=dst, layer=-1, stage=-1, seq=-1, tokens=0)
    wire.encode_control(buffer, header, text)
    return buffer


def _ffn_link() -> tuple[PeerLink, _Group]:
    group = _Group()
    return PeerLink(Topology(2, 1, 2), 2, group), group  # global rank 2: the FFN rank of 2A1F


@pytest.mark.parametrize("abort_lag_s", [0.0, 0.1])
def test_a_peer_that_said_why_before_its_connection_closed_is_named_with_its_reason(abort_lag_s: float) -> None:
    """Attention rank 1 failed because it lost another rank, sent ABORT with that reason, and
    exited; its ABORT reaches this rank up to ``abort_lag_s`` after the data receive failed."""
    link, group = _ffn_link()
    header = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
    data = link.irecv(header, 1, wire.TAG_DISPATCH_HEADER, "dispatch header")
    reason = "attention rank 1 (global rank 1): lost FFN rank 0 (global rank 2): its connection closed"
    group.recvs[(1, wire.TAG_DISPATCH_HEADER)].fail("Connection closed by peer")
    deliver = threading.Timer(abort_lag_s, group.recvs[(1, wire.TAG_CONTROL)].complete, [_abort_message(1, 2, reason)])
    deliver.start()
    with pytest.raises(PeerAborted) as info:
        link.wait([data], timeout_s=5, work=None, action="receiving layer=0", option="recv_timeout_s")
    deliver.join()
    assert info.value.peer == 1 and reason in str(info.value)


def test_a_peer_that_died_without_a_word_is_named_lost_after_the_settle_wait() -> None:
    link, group = _ffn_link()
    header = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
    data = link.irecv(header, 0, wire.TAG_DISPATCH_HEADER, "dispatch header")
    group.recvs[(0, wire.TAG_DISPATCH_HEADER)].fail("Connection closed by peer")
    start = time.monotonic()
    with pytest.raises(PeerLost) as info:
        link.wait([data], timeout_s=5, work=None, action="receiving layer=0", option="recv_timeout_s")
    assert info.value.peer == 0 and "attention rank 0 (global rank 0)" in str(info.value)
    assert time.monotonic() - start < 2.0  # the settle wait is bounded


def test_abort_lingers_after_its_notices_went_out_so_peers_can_read_them_before_the_exit() -> None:
    """A rank that exits right after ``abort`` with unread data resets its connections, and a reset
    drops what the peer had not read yet, the ABORT included: abort keeps the process alive for the
    linger once a notice went out, and returns at once when none could go out (every peer gone)."""
    link, _ = _ffn_link()
    start = time.monotonic()
    link.abort("FFN rank 0 failed", linger_s=0.3)
    assert time.monotonic() - start >= 0.3
    alone, group = _ffn_link()
    for peer in (0, 1):  # both peers' connections already closed: no notice can go out
        group.recvs[(peer, wire.TAG_CONTROL)].fail("Connection closed by peer")
    time.sleep(0.1)  # the control watchers take the failures
    start = time.monotonic()
    alone.abort("FFN rank 0 failed", linger_s=5.0)
    assert time.monotonic() - start < 1.0


def _recv(link: PeerLink, groups: dict[int, _Group], peer: int, tag: int) -> _Work:
    """The fake work of the receive ``link`` posted from global rank ``peer`` on ``tag`` (on ``peer``'s pair,
    where the peer is pair rank 0, or on the one group, keyed ``-1``)."""
    return groups[peer].recvs[(0, tag)] if link.scoped else groups[-1].recvs[(peer, tag)]


@pytest.mark.parametrize("on_pairs", [True, False], ids=["pairs", "one-group"])
def test_a_wait_on_pairs_fails_only_for_the_peers_it_waits_on(on_pairs: bool) -> None:
    """The FFN rank of 2A1F waits on attention rank 1 while attention rank 0's connection closes: a link on
    pairs (independent engines, the vLLM path: scoped faults) completes the wait; a link on one group of
    every rank (``afd-mrv2 run``) names the lost rank."""
    topology = Topology(2, 1, 2)
    if on_pairs:
        groups = {peer: _Group() for peer in (0, 1)}
        link = PeerLink(topology, 2, pairs={a: Pair(g, 1, 0, f"a{a}.1-f0.1") for a, g in groups.items()})
    else:
        groups = {-1: _Group()}
        link = PeerLink(topology, 2, groups[-1])
    assert link.scoped is on_pairs
    header = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
    data = link.irecv(header, 1, wire.TAG_DISPATCH_HEADER, "dispatch header")
    _recv(link, groups, 0, wire.TAG_CONTROL).fail("Connection closed by peer")  # attention rank 0 died
    threading.Timer(0.3, _recv(link, groups, 1, wire.TAG_DISPATCH_HEADER).complete).start()
    if on_pairs:
        link.wait([data], timeout_s=5, work=None, action="serving", option="recv_timeout_s")
        assert data.done.is_set() and data.error is None
        with pytest.raises(PeerLost, match=r"lost attention rank 0 \(global rank 0\)"):
            link.check_peers({0})  # a wait on the dead rank itself still names it
        link.check_peers({1})
    else:
        with pytest.raises(PeerLost, match=r"lost attention rank 0 \(global rank 0\)"):
            link.wait([data], timeout_s=5, work=None, action="serving", option="recv_timeout_s")


def test_a_link_runs_on_one_group_or_on_pairs_never_both() -> None:
    with pytest.raises(ValueError, match=r"^a PeerLink runs on one group or on pairs, not both$"):
        PeerLink(Topology(1, 1, 2), 1, _Group(), pairs={0: Pair(_Group(), 1, 0)})
    with pytest.raises(RuntimeError, match=r"a link on one process group cannot take a new pair"):
        PeerLink(Topology(1, 1, 2), 1, _Group()).install(0, Pair(_Group(), 1, 0))


def test_a_pair_is_named_by_its_incarnations_and_generation_is_deprecated() -> None:
    pair = Pair(_Group(), 1, 0, "a0.1-f0.2")
    link = PeerLink(Topology(1, 1, 2), 1, pairs={0: pair})
    assert pair.name == link.pair_name(0) == "a0.1-f0.2"
    assert PeerLink(Topology(1, 1, 2), 1, _Group()).pair_name(0) == ""  # a one-group link has no pair
    with pytest.warns(DeprecationWarning, match=r"^Pair\.generation is deprecated: use Pair\.name$"):
        assert pair.generation == "a0.1-f0.2"
    with pytest.warns(DeprecationWarning, match=r"^PeerLink\.generation is deprecated: use PeerLink\.pair_name$"):
        assert link.generation(0) == "a0.1-f0.2"
