"""Expert replicas on the vLLM path's vLLM-free parts: an FFN rank killed (SIGKILL, its own process) while
it computes an item costs the Attention side no answer.  The Attention side re-sends the lost rank's
share of the item in flight to the live holders (``redispatch``), routes to them from then on, and every
output still equals the unsharded reference.  Without replicas the same kill fails the call, naming the
rank, as it always did.  Each test runs on every pair transport (``afd.transport`` gloo, zmq and tcp)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import PipelineError
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.mrv2.ffn.report import FfnReport
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.mrv2.transport.store import RendezvousStore
from afd_mrv2.procs import free_port
from afd_mrv2.topology import Topology
from tests.mrv2.test_free_topologies import _moe, _weights
from tests.mrv2.test_vllm_path import LAYERS, afd, pair_transport, start_ffn

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, TOP_K = 16, 2

#: One FFN rank as its own process: serves the full experts (ids stay global) and, on its
#: ``stall_at``-th expert computation, says "computing" and sleeps until it is killed.
FFN_PROCESS = """
import json, sys, time, torch
from afd_mrv2.mrv2.ffn.server import ffn_serving_config, serve_ffn
from afd_mrv2.mrv2.shape import MoeShape
from tests.mrv2.test_free_topologies import _moe, _weights
from tests.mrv2.test_vllm_path import LAYERS, afd
raw, experts, stall_at = eval(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
shape = MoeShape(16, 2, experts)
calls = [0]
def experts_of(layer):
    weights = _weights(shape, layer)
    def run(x, w, ids):
        calls[0] += 1
        if calls[0] == stall_at:
            print("computing", flush=True)
            time.sleep(600)
        return _moe(weights, x, w, ids)
    return run
report = serve_ffn(ffn_serving_config(raw), [experts_of(layer) for layer in range(len(LAYERS))], shape,
                   max_tokens=16, dtype=torch.float32, device=torch.device("cpu"), index=raw["rank"])
print("report", json.dumps(report.as_dict()), flush=True)
"""


def _held_experts(shape: MoeShape, layer: int, held: tuple[int, ...]) -> Any:
    """One MoE layer holding only the experts ``held`` (ids arrive mapped onto their positions)."""
    weights = _weights(shape, layer).index_select(0, torch.tensor(held))

    def run(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert int(ids.min()) >= 0 and int(ids.max()) < len(held), "ids must be positions among the held experts"
        return _moe(weights, x, w, ids)

    return run


def _checked_forward(remote: RemoteExperts, shape: MoeShape, gen: torch.Generator, tokens: int) -> None:
    """One forward through every MoE layer, each output checked against the unsharded reference."""
    for ordinal, layer in enumerate(LAYERS):
        x, w = torch.randn(tokens, HIDDEN, generator=gen), torch.rand(tokens, TOP_K, generator=gen)
        ids = torch.randint(0, shape.num_experts, (tokens, TOP_K), generator=gen, dtype=torch.int32)
        out = remote.exchange(layer, x, w, ids)
        torch.testing.assert_close(out, _moe(_weights(shape, ordinal), x, w, ids), rtol=1e-5, atol=1e-5)


def _start_holder(
    done: dict[str, Any], port: int, ranks: dict[str, Any], shape: MoeShape, f: int, transport: str
) -> threading.Thread:
    """FFN rank ``f`` on a thread of this process, holding only its experts (``ranks`` says the placement),
    its pairs on ``transport``."""
    topology = Topology(1, ranks["num_ffn_ranks"], shape.num_experts, ranks.get("expert_replicas", 1))
    return start_ffn(
        done,
        {**afd("ffn", port, transport=transport), **ranks, "rank": f},
        [_held_experts(shape, layer, topology.held_by(f)) for layer in range(len(LAYERS))],
        key=f,
        shape=shape,
        max_tokens=16,
        index=f,
        local_experts_only=True,
    )


def _external_1a2f() -> tuple[MoeShape, int, RendezvousStore, dict[str, Any]]:
    """1A2F with R = 2 on a store hosted here (``rendezvous: external``, as serve does): shape, port, store, ranks."""
    port = free_port()
    store = RendezvousStore.connect("127.0.0.1", port, master=True, timeout_s=30)
    ranks = {"num_attention_ranks": 1, "num_ffn_ranks": 2, "expert_replicas": 2, "rendezvous": "external"}
    return MoeShape(HIDDEN, TOP_K, 4), port, store, ranks


def _spawn_ffn(raw: dict[str, Any], experts: int, stall_at: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", FFN_PROCESS, repr(raw), str(experts), str(stall_at)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _attention(port: int, ranks: dict[str, Any], shape: MoeShape, transport: str) -> RemoteExperts:
    """Attention rank 0 of ``ranks`` with every MoE layer registered, its pairs on ``transport``."""
    section = {**afd("attention", port, transport=transport), **ranks, "rank": 0}
    remote = RemoteExperts(parse_afd_config(section), max_tokens=16)
    for layer in LAYERS:
        remote.add_layer(layer, shape)
    return remote


def _end(*procs: subprocess.Popen[str] | None) -> None:
    """Let each FFN process end on its own (its session ends once the store says stop), else kill it."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _report_of(proc: subprocess.Popen[str] | None) -> dict[str, Any]:
    """The ``report`` line an FFN process printed when its session ended."""
    assert proc is not None and proc.stdout is not None
    lines = proc.stdout.read().splitlines()
    report: dict[str, Any] = json.loads(
        next(line for line in lines if line.startswith("report ")).removeprefix("report ")
    )
    return report


def _run(
    ffn: int, experts: int, replicas: int, killed: int, transport: str
) -> tuple[list[Any], dict[str, Any], RemoteExperts]:
    """1 Attention rank, ``ffn`` FFN ranks, FFN rank ``killed`` a process killed mid-item; pairs on ``transport``.

    Returns (the outcome of each forward: None when exact, else the exception), the FFN threads' results,
    and the Attention side."""
    shape = MoeShape(HIDDEN, TOP_K, experts)
    port = free_port()
    ranks = {"num_attention_ranks": 1, "num_ffn_ranks": ffn, "expert_replicas": replicas}
    done: dict[str, Any] = {}
    servers = [_start_holder(done, port, ranks, shape, f, transport) for f in range(ffn) if f != killed]
    victim = _spawn_ffn({**afd("ffn", port, transport=transport), **ranks, "rank": killed}, experts, 3)
    remote = _attention(port, ranks, shape, transport)
    outcomes: list[Any] = []

    def forwards() -> None:
        gen = torch.Generator().manual_seed(7)
        for tokens in (16, 16, 5, 16, 1):
            try:
                _checked_forward(remote, shape, gen, tokens)
                outcomes.append(None)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                outcomes.append(exc)
                return

    client = threading.Thread(target=forwards, daemon=True)
    try:
        client.start()
        assert victim.stdout is not None and victim.stdout.readline().strip() == "computing"
        os.killpg(victim.pid, signal.SIGKILL)  # mid-item: its share of the item in flight is unanswered
        victim.wait(10)
        client.join(60)
        assert not client.is_alive(), "the Attention side hung after the kill"
    finally:
        remote.close()
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
    for thread in servers:
        thread.join(60)
    return outcomes, done, remote


@pytest.mark.parametrize(
    ("ffn", "experts", "killed"),
    [(2, 4, 1), (2, 4, 0), (3, 6, 0), (3, 6, 1), (3, 6, 2)],
    ids=["1A2F-kill-1", "1A2F-kill-0", "1A3F-kill-0", "1A3F-kill-1", "1A3F-kill-2"],
)
def test_an_ffn_rank_killed_mid_item_with_replicas_costs_no_answer(
    one_torch_thread: None, capfd: pytest.CaptureFixture[str], transport: str, ffn: int, experts: int, killed: int
) -> None:
    outcomes, done, remote = _run(ffn, experts, replicas=2, killed=killed, transport=transport)
    assert outcomes == [None] * 5, outcomes  # every forward answered, exact
    assert not any("error" in k for k in done), done
    log = remote.stats()["failover"]
    assert log is not None and log["failovers"] == 1 and list(log["lost"]) == [str(killed)], log
    reason = log["lost"][str(killed)]["reason"]  # the loss as the pair's own transport saw it
    assert f"lost FFN rank {killed} (global rank {killed + 1}" in reason and f"[{transport}: " in reason, reason
    assert log["resent_items"] >= 1 and log["resent_rows"] >= 1, log
    assert log["first_resend_at"][str(killed)] >= log["lost"][str(killed)]["at"]
    err = capfd.readouterr().err
    primary = Topology(1, ffn, experts, 2).placement.ranges([e for e in range(experts) if e * ffn // experts == killed])
    assert "afd-mrv2 failover: attention rank 0 (global rank 0" in err, err
    assert f"FFN rank {killed} lost (PeerLost); the experts it computed, {primary}, go to" in err, err
    served: dict[int, FfnReport] = {f: done[f"report{f}"] for f in range(ffn) if f != killed}
    placement = Topology(1, ffn, experts, 2).placement
    # the re-sends went to the ring successor: the next holder of every expert the lost rank computed
    successor = (killed + 1) % ffn
    assert {placement.route(e, set(served)) for e in range(experts) if placement.holders[e][0] == killed} == {successor}
    assert served[successor].redispatched == log["resent_items"], {f: r.as_dict() for f, r in served.items()}
    assert all(r.redispatched == 0 for f, r in served.items() if f != successor)


def test_without_replicas_an_ffn_rank_killed_mid_item_fails_the_call_naming_it(
    one_torch_thread: None, transport: str
) -> None:
    outcomes, _, remote = _run(2, 4, replicas=1, killed=1, transport=transport)
    assert outcomes[:-1] == [None] * (len(outcomes) - 1) and isinstance(outcomes[-1], PipelineError), outcomes
    assert "lost FFN rank 1 (global rank 2" in str(outcomes[-1]), outcomes[-1]
    assert "PeerLost: " in str(outcomes[-1]) and f"[{transport}: " in str(outcomes[-1]), outcomes[-1]
    assert remote.stats()["failover"]["failovers"] == 0


def _forwards_until(remote: RemoteExperts, shape: MoeShape, enough: threading.Event, outcomes: list[Any]) -> None:
    """Checked forwards until ``enough`` or the first failure; each outcome None when exact, else the exception."""
    gen = torch.Generator().manual_seed(3)
    while not enough.is_set():
        try:
            _checked_forward(remote, shape, gen, 9)
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcomes.append(exc)
            return
        time.sleep(0.02)


def _wait_for(remote: RemoteExperts, what: str, deadline: float, client: threading.Thread, outcomes: list[Any]) -> None:
    """Until the Attention side's failover record counts ``what`` (``failovers``, ``rejoins``)."""
    while not (remote.failovers() or {}).get(what):
        assert time.monotonic() < deadline and client.is_alive(), outcomes[-1:]
        time.sleep(0.05)


def test_a_restarted_ffn_rank_is_taken_back_at_a_step_boundary(
    one_torch_thread: None, capfd: pytest.CaptureFixture[str], transport: str
) -> None:
    """The store hosted outside the ranks (``rendezvous: external``, as serve does): FFN rank 1 is killed
    mid-item and the Attention side fails over; a new FFN rank 1 process then registers as the next
    incarnation, the Attention side joins its pair on a thread of its own and takes it back between two
    forwards; the new process serves items again (its experts are primary there) and every output stays
    exact throughout."""
    shape, port, store, ranks = _external_1a2f()
    experts = shape.num_experts
    done: dict[str, Any] = {}
    section = {**afd("ffn", port, transport=transport), **ranks, "rank": 1}
    survivor = _start_holder(done, port, ranks, shape, 0, transport)
    victim = _spawn_ffn(section, experts, 3)
    remote = _attention(port, ranks, shape, transport)
    enough = threading.Event()
    outcomes: list[Any] = []
    client = threading.Thread(target=_forwards_until, args=(remote, shape, enough, outcomes), daemon=True)
    restarted = None
    try:
        client.start()
        assert victim.stdout is not None and victim.stdout.readline().strip() == "computing"
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
        deadline = time.monotonic() + 30
        _wait_for(remote, "failovers", deadline, client, outcomes)
        restarted = _spawn_ffn(section, experts, 0)
        _wait_for(remote, "rejoins", deadline + 60, client, outcomes)
        calls = len(outcomes)
        while len(outcomes) < calls + 10 and client.is_alive():  # a few forwards with the rank back
            time.sleep(0.05)
        assert pair_transport(port, "a0.1-f1.2") == transport  # the pair with the new process
        enough.set()
        client.join(30)
        assert not client.is_alive()
    finally:
        enough.set()
        remote.close()
        store.request_stop()  # the FFN ranks serve no new incarnation: their sessions end
        _end(victim, restarted)
    survivor.join(30)
    assert outcomes and all(o is None for o in outcomes), [o for o in outcomes if o is not None][:1]
    assert not survivor.is_alive() and "error0" not in done, done
    report = _report_of(restarted)
    assert report["items"] >= 10 and report["computed"] > 0, report  # the new process served again
    log = remote.failovers()
    assert log is not None and log["failovers"] == 1 and log["rejoins"] == 1, log
    assert log["rejoined_at"]["1"] > log["lost"]["1"]["at"]
    assert f"[{transport}: " in log["lost"]["1"]["reason"], log
    err = capfd.readouterr().err
    assert "afd-mrv2 rejoin: attention rank 0 (global rank 0" in err and "FFN rank 1 is back (pair a0.1-f1.2)" in err


def test_an_engine_that_starts_while_an_ffn_rank_is_lost_routes_around_it_and_takes_it_back_later(
    one_torch_thread: None, transport: str
) -> None:
    """serve marks a lost FFN rank in the store; an Attention engine that starts meanwhile (a restarted one)
    does not wait for it: it starts without a pair with it, routes its experts to their other holder, and
    takes it back once it is restarted."""
    from afd_mrv2.items import FFN

    shape, port, store, ranks = _external_1a2f()
    experts = shape.num_experts
    store.register(FFN, 1)  # FFN rank 1's first process registered ...
    store.mark_lost(FFN, 1)  # ... and was lost
    done: dict[str, Any] = {}
    survivor = _start_holder(done, port, ranks, shape, 0, transport)
    remote = _attention(port, ranks, shape, transport)
    gen = torch.Generator().manual_seed(5)
    restarted = None

    def forward() -> None:
        _checked_forward(remote, shape, gen, 6)

    try:
        forward()  # started without FFN rank 1: exact, through FFN rank 0 alone
        assert remote.failovers()["failovers"] == 0
        restarted = _spawn_ffn({**afd("ffn", port, transport=transport), **ranks, "rank": 1}, experts, 0)
        deadline = time.monotonic() + 60
        while not remote.failovers()["rejoins"]:
            assert time.monotonic() < deadline
            forward()
            time.sleep(0.05)
        for _ in range(3):
            forward()
        assert [pair_transport(port, pair) for pair in ("a0.1-f0.1", "a0.1-f1.2")] == [transport] * 2
    finally:
        remote.close()
        store.request_stop()
        _end(restarted)
    survivor.join(30)
    assert not survivor.is_alive() and "error0" not in done, done
    report = _report_of(restarted)
    assert report["items"] >= 3 * len(LAYERS) and report["computed"] > 0, report
