"""Faults of ``afd-mrv2 serve`` on real vLLM: each test starts a serve of its own.

* a malformed ``afd`` section (or one the vLLM seam cannot serve): exit 2, one line, nothing started;
* SIGKILL of a role's process mid-generation, the FFN role's (``python -m afd_mrv2.mrv2.ffn.role``)
  or the Attention engine's (the vLLM API server serve started, whose EngineCore child
  lives on in the role's process group): every in-flight request gets an error response
  (no hang) and serve exits 1 within 10 s naming the role, its rank and pid; nothing of
  the killed role's process group survives.  Also with micro-batched Attention steps
  (``--ubatches 2`` on Model Runner V2, the test-only triton stand-in): the FFN killed
  while both micro-batches have round trips in flight; every streamed client gets its
  error within 1 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2.procs import alive, group_alive
from tests.serve.conftest import free_port_block
from tests.vllm.engine import PROMPTS
from tests.vllm.harness import FfnRole, afd_section, make_model, v2_env
from tests.vllm.serving import Serve, body, complete, ffn_reports, stream

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("faults-mixtral") / "model", "mixtral")


@pytest.mark.parametrize(
    ("afd", "key"),
    [
        ('{"multistream": {"depth": 0}}', "afd.multistream.depth"),
        ('{"connectr": "torch_p2p"}', "afd.connectr"),
        ('{"compute_gate_on_attention": false}', "afd.compute_gate_on_attention"),
        ('{"rank": 0}', "afd.rank"),
    ],
    ids=["bad-depth", "unknown-key", "gate-on-ffn", "rank-given"],
)
def test_malformed_afd_section_exits_2_one_line_nothing_started(model: Path, afd: str, key: str) -> None:
    exe = Path(sys.executable).with_name("afd-mrv2")
    cmd = [str(exe), "serve", str(model), "--attention", "1", "--ffn", "1", "--port", str(free_port_block(3))]
    start = time.monotonic()
    proc = subprocess.run([*cmd, "--afd", afd], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    print(f"\n[faults] --afd {afd}: exit {proc.returncode} in {took:.1f} s: {lines}", flush=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith(f"afd-mrv2 serve: error: {key}"), lines
    assert "started pid" not in proc.stderr


UBATCHED = ["--ubatches", "2", "--afd", '{"ubatch": {"decode_token_threshold": 2, "prefill_token_threshold": 2}}']


def _mixed_clients(
    url: str, model: Path, tokens: int
) -> tuple[list[Any], list[float], list[threading.Thread], threading.Event]:
    """8 greedy requests of ``tokens`` tokens started now, the odd ones streamed; (results, each one's finishing
    time, threads, first-streamed-token event)."""
    results: list[Any] = [None] * 8
    finished: list[float] = [0.0] * 8
    first = threading.Event()

    def client(i: int) -> None:
        payload = body(model, PROMPTS[i], tokens)
        results[i] = stream(url, payload, first=first) if i % 2 else complete(url, payload)
        finished[i] = time.monotonic()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    return results, finished, threads, first


@pytest.mark.parametrize(
    ("role", "ubatched", "transport"),
    [
        pytest.param("ffn", False, "gloo", marks=pytest.mark.vllm_full),
        pytest.param("attention", False, "gloo", marks=pytest.mark.vllm_full),
        ("ffn", True, "gloo"),
        pytest.param("ffn", True, "zmq", marks=pytest.mark.vllm_full),
        pytest.param("attention", False, "zmq", marks=pytest.mark.vllm_full),
        pytest.param("ffn", True, "tcp", marks=pytest.mark.vllm_full),
        pytest.param("attention", False, "tcp", marks=pytest.mark.vllm_full),
    ],
)
def test_role_sigkill_mid_generation_fails_in_flight_requests_and_serve_exits_naming_it(
    model: Path, tmp_path: Path, role: str, ubatched: bool, transport: str
) -> None:
    args, env = (UBATCHED, v2_env()) if ubatched else ([], None)
    serve = Serve(model, free_port_block(3), tmp_path / "serve.log", *args, "--transport", transport, env=env)
    try:
        ready_s = serve.wait_ready()
        pid = serve.role_pid(f"{role} 0")  # the role's first process, leader of its process group
        results, finished, threads, first = _mixed_clients(serve.url, model, 200)
        assert first.wait(120), "no streamed token arrived"
        time.sleep(0.5)  # mid-generation: 200 tokens each take far longer
        killed = time.monotonic()
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
        code = serve.wait_exit(30)
        exited = time.monotonic() - killed
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        answered = max(finished) - killed
        streamed = max(finished[i] for i in range(1, 8, 2)) - killed
        log = serve.log_text()
        last = log.strip().splitlines()[-1]
        print(
            f"\n[faults] {'micro-batched ' if ubatched else ''}ready after {ready_s:.1f} s; {role} pid {pid} "
            f"SIGKILLed mid-generation: every client answered within {answered:.2f} s (streamed clients "
            f"{streamed:.2f} s), serve exited {code} after {exited:.2f} s: {last}",
            flush=True,
        )
        for i, (status, answer) in enumerate(results):
            if i % 2:  # streamed: the last event is an error, never a finished completion
                # (cut by serve's proxy, or vLLM's own error event, which vLLM follows with [DONE])
                events = [e for e in answer or [] if e != "[DONE]"]
                assert status in (-1, 200) and events, (i, answer)
                assert "error" in str(events[-1]).lower(), (i, answer[-2:])
            else:
                assert status != 200, (i, answer)
        assert code == 1
        assert exited < 10
        if ubatched:
            assert streamed < 1.0, streamed
        assert last.startswith(f"afd-mrv2 serve: error: {role} rank 0 (pid {pid}) exited (signal SIGKILL)"), last
        assert not alive(pid)
        assert not group_alive(pid), f"a process of {role} 0's group survived (vLLM's EngineCore?)"
        assert serve.stdout == [f"afd-mrv2 serve: ready at {serve.url}/v1"]
    finally:
        serve.stop()


def _completed(result: tuple[int, Any], *, streamed: bool, tokens: int) -> bool:
    """A request that finished: 200 and ``tokens`` tokens; streamed, text and ``[DONE]`` with no error event."""
    status, answer = result
    if streamed:
        events = [e for e in answer if e != "[DONE]"]
        text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e)
        return status == 200 and answer[-1] == "[DONE]" and bool(text) and "error" not in str(events[-1])
    return status == 200 and answer["usage"]["completion_tokens"] == tokens


def _serve_through_restart(serve: Serve, model: Path) -> int:
    """Requests answered while serve restarts a lost engine (each must succeed); how many, once it is back."""
    deadline = time.monotonic() + 600
    during = 0
    while "restarted: ready after" not in serve.log_text():
        assert time.monotonic() < deadline and serve.proc.poll() is None, serve.log_text()[-3000:]
        status, answer = complete(serve.url, body(model, PROMPTS[0], 4))
        assert status == 200, answer
        during += 1
    return during


@pytest.mark.vllm_full
def test_one_of_two_engines_killed_mid_generation_the_other_and_the_ffn_rank_serve_on(
    model: Path, tmp_path: Path
) -> None:
    """2A1F: SIGKILL of attention rank 1's whole process group (API server, EngineCore, worker) while 8
    clients generate.  Its clients get errors, never a hang; attention rank 0's complete; the FFN rank
    goes on serving rank 0 (faults scoped to a peer), so every later request succeeds, also while serve
    restarts engine 1; the restarted engine joins a new pair with the FFN rank and serves requests again;
    serve keeps running until SIGTERM, then exits 0 and the FFN's report says how each engine left."""
    serve = Serve(model, free_port_block(4), tmp_path / "serve.log", attention=2, ffn=1)
    tokens = 48
    try:
        ready_s = serve.wait_ready()
        pid = serve.role_pid("attention 1")
        results, _finished, threads, first = _mixed_clients(serve.url, model, tokens)
        assert first.wait(120), "no streamed token arrived"
        time.sleep(0.5)
        killed = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        answered = time.monotonic() - killed
        done = [i for i in range(8) if _completed(results[i], streamed=bool(i % 2), tokens=tokens)]
        assert len(done) == 4, results  # least-outstanding: four on each engine; rank 0's four complete
        assert serve.proc.poll() is None, "serve stopped"
        after = [complete(serve.url, body(model, PROMPTS[i], 8)) for i in range(4)]
        assert all(status == 200 and a["usage"]["completion_tokens"] == 8 for status, a in after), after
        (line,) = [line for line in serve.log_text().splitlines() if "the endpoint serves on with" in line]
        assert line.startswith(f"[serve] attention rank 1 (pid {pid}) exited (signal SIGKILL"), line
        assert line.endswith("): the endpoint serves on with attention 0 (1 of 2 Attention engines)"), line
        during = _serve_through_restart(serve, model)
        restarted_in = time.monotonic() - killed
        (back,) = [line for line in serve.log_text().splitlines() if "restarted: ready after" in line]
        engine_1 = serve.engine_urls()[1]
        status, answer = complete(engine_1, body(model, PROMPTS[1], 8))  # the new engine itself, through the FFN
        assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
        print(
            f"\n[faults] 2A1F ready after {ready_s:.1f} s; attention rank 1 killed mid-generation: clients answered "
            f"within {answered:.2f} s, {len(done)}/8 completed (attention rank 0's), 4/4 later requests served, "
            f"{during} more during the restart; engine 1 back {restarted_in:.1f} s after the kill: {back}",
            flush=True,
        )
    finally:
        code = serve.stop()
    assert code == 0
    reports = ffn_reports(serve.log_text())
    ends = reports[0]["ends"]
    print(f"[faults] FFN rank 0: items per engine {reports[0]['items_per_attention']}, ends {ends}", flush=True)
    # engine 1's items: both incarnations; its last end: the restarted engine's stop at the end
    assert ends["0"].startswith("left between steps: attention rank 0") and "attention rank 1" in ends["1"], ends
    assert reports[0]["items_per_attention"]["0"] > 0 and reports[0]["items_per_attention"]["1"] > 0


@pytest.mark.vllm_full
def test_ffn_role_killed_alone_takes_its_engine_down(model: Path, tmp_path: Path) -> None:
    """SIGKILL of only the FFN role process (started as serve starts it: leader of its own group).

    vLLM's EngineCore and worker are its children and got no signal; before afd-mrv2's
    leader watch they stayed alive and kept serving.  Now the serving worker sees the
    leader gone and ends the role's process group."""
    ffn = FfnRole(model, afd_section("ffn", free_port_block(3)), tmp_path / "ffn.log", "0", new_session=True)
    try:
        ffn.wait_ready()
        time.sleep(2.0)  # the worker runs afd_ffn_serve: its link waits for an Attention engine
        pid = ffn.proc.pid
        assert group_alive(pid)
        killed = time.monotonic()
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
        ffn.proc.wait(10)
        deadline = killed + 20
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        gone_s = time.monotonic() - killed
        log = ffn.log.read_text()
        print(f"\n[faults] ffn_role leader pid {pid} SIGKILLed alone: its group gone after {gone_s:.1f} s", flush=True)
        assert not group_alive(pid), f"the engine outlived its FFN role process by 20 s:\n{log[-2000:]}"
        assert f"afd-mrv2 ffn: the FFN role process (pid {pid}) is gone: ending its engine" in log, log[-2000:]
    finally:
        ffn.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ffn.proc.pid, signal.SIGKILL)
