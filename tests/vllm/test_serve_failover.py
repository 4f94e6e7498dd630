"""Lose an FFN rank, lose no request: ``afd-mrv2 serve --expert-replicas 2`` at 1A2F on real vLLM.

32 concurrent streamed greedy requests of 64 tokens (logprobs on); mid-generation the whole process
group of one FFN rank gets SIGKILL (its role leader, vLLM's EngineCore and worker).  The Attention
engine notices the lost rank within the link deadline, re-sends that rank's share of every item in
flight to the other holder of its experts (``redispatch``) and routes there from then on:

* all 32 complete, and no client sees an error;
* at least 31 of 32 are token-identical to plain vLLM (afd-mrv2 installed, no ``afd`` section) with
  max |logprob difference| <= 1e-4 (the failed-over items sum their partials in another order);
* serve says so in one line and serves on; ``/metrics`` shows one live FFN rank, one failover on
  serve's side and on the engine's, and the surviving rank's re-sends; later requests are served;
* serve restarts the rank; the engine takes it back at a step boundary (``afd-mrv2 rejoin`` on its
  stderr): ``/metrics`` then shows two live FFN ranks and one restart, and the rejoined rank's item
  counter grows again under new requests;
* the times from the kill to the engine's failover, to its first re-send and to the rejoin are printed.

Mixtral with FFN rank 1 killed runs in the reduced matrix; FFN rank 0 killed, and qwen2_moe (its shared
experts stay on the Attention side), are ``vllm_full``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.serve.conftest import free_port_block
from tests.vllm.harness import make_model, v2_env
from tests.vllm.serving import PlainServer, Serve, body, compare, complete, complete_all, greedy, stream
from tests.vllm.test_serve_faults import UBATCHED

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(1800)]

TOKENS = 64
CLIENTS = 32
PROMPT_WORDS = ("the", "a", "one", "some")
SUBJECTS = ("cat", "river", "engine", "garden", "letter", "mountain", "city", "song")


def prompts() -> list[str]:
    return [f"{w} {s} of the day" for w in PROMPT_WORDS for s in SUBJECTS][:CLIENTS]


def payloads(model: Path) -> list[dict[str, Any]]:
    return [body(model, p, TOKENS, logprobs=1, return_token_ids=True) for p in prompts()]


def streamed_greedy(events: list[Any]) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of a streamed completion (``return_token_ids``, ``logprobs: 1``)."""
    ids: list[int] = []
    logprobs: list[float] = []
    for event in events:
        if not isinstance(event, dict) or not event.get("choices"):
            continue
        choice = event["choices"][0]
        ids += choice.get("token_ids") or []
        logprobs += [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    return ids, logprobs


class Checkpoints:
    """One checkpoint per architecture and plain vLLM's answers on it, made once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Path] = {}
        self._plain: dict[str, list[tuple[list[int], list[float]]]] = {}

    def model(self, arch: str) -> Path:
        if arch not in self._models:
            self._models[arch] = make_model(self.root / arch / "model", arch)
        return self._models[arch]

    def plain(self, arch: str) -> list[tuple[list[int], list[float]]]:
        if arch not in self._plain:
            model = self.model(arch)
            server = PlainServer(model, free_port_block(1), self.root / arch / "plain.log")
            try:
                server.wait_ready()
                got = complete_all(server.url, payloads(model))
            finally:
                server.stop()
            assert all(status == 200 for status, _ in got), got
            self._plain[arch] = [greedy(a) for _, a in got]  # type: ignore[arg-type]
        return self._plain[arch]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("failover"))


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _stream_bodies(url: str, bodies: list[dict[str, Any]]) -> tuple[list[Any], list[threading.Thread], threading.Event]:
    """One streamed request per body, started now; (results, threads, first-event)."""
    results: list[Any] = [None] * len(bodies)
    first = threading.Event()

    def client(i: int, payload: dict[str, Any]) -> None:
        results[i] = stream(url, payload, first=first)

    threads = [threading.Thread(target=client, args=c, daemon=True) for c in enumerate(bodies)]
    for t in threads:
        t.start()
    return results, threads, first


def _stream_all(
    url: str, model: Path, n: int, tokens: int
) -> tuple[list[Any], list[threading.Thread], threading.Event]:
    """``n`` streamed greedy requests of ``tokens`` tokens, started now; (results, threads, first-event)."""
    return _stream_bodies(url, [body(model, p, tokens) for p in prompts()[:n]])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def _kill_mid_generation(serve: Serve, model: Path, pid: int) -> tuple[list[Any], int, float, float]:
    """Stream the 32 requests, SIGKILL the process group ``pid`` leads mid-generation and wait for every client;
    (results, requests finished before the kill, the kill's wall time, seconds from the kill to the last answer)."""
    results, threads, first = _stream_bodies(serve.url, payloads(model))
    assert first.wait(300), "no streamed token arrived"
    time.sleep(0.3)  # mid-generation: 64 tokens of 32 requests take longer
    killed_at = time.time()
    os.killpg(pid, signal.SIGKILL)
    before = sum(1 for r in results if r is not None)  # requests already finished at the kill
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads), "a client hangs"
    return results, before, killed_at, time.time() - killed_at


def _metrics_once_resent(serve: Serve, resent: str) -> str:
    """``/metrics`` once it counts a re-send (``resent``), or after 10 s (the roles' figures are up to a second old)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = _get(serve.url + "/metrics")
        if (metric(metrics, resent) or 0) >= 1 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def _wait_for_rejoin(serve: Serve, model: Path, killed: int, deadline: float) -> re.Match[str]:
    """Serve restarts the rank; the engine takes it back at its next step: the rejoin line's match."""
    while "restarted: ready after" not in serve.log_text():
        assert time.monotonic() < deadline and serve.proc.poll() is None, serve.log_text()[-3000:]
        time.sleep(1.0)
    while True:
        assert time.monotonic() < deadline, serve.log_text()[-3000:]
        complete(serve.url, body(model, prompts()[0], 4))  # steps, so the engine reaches a step boundary
        rejoined = re.search(rf"afd-mrv2 rejoin: .*FFN rank {killed} is back .*\(at ([0-9.]+)\)", serve.log_text())
        if rejoined is not None:
            return rejoined


def _metrics_once_rejoined_rank_serves(
    serve: Serve, model: Path, killed: int, killed_at: float, deadline: float
) -> str:
    """``/metrics`` once the restarted rank's own item counter (its figures start from 0, written after the kill)
    grew under new requests."""
    base = None
    while True:
        figures = json.loads(_get(serve.url + "/afd/status"))["figures"].get(f"ffn {killed}") or {}
        back = _get(serve.url + "/metrics")
        if figures.get("at", 0) <= killed_at:  # still the killed process's figures
            figures = {}
        count = figures.get("items")
        if base is None and count is not None:
            base = count
        elif base is not None and count is not None and count > base:
            return back
        assert time.monotonic() < deadline, (figures, back)
        complete_all(serve.url, payloads(model)[:8])
        time.sleep(1.0)


@pytest.mark.parametrize(
    ("arch", "killed", "transport"),
    [
        ("mixtral", 1, "tcp"),  # the default transport: CI's reduced matrix; the others in the full one (5 min)
        pytest.param("mixtral", 1, "gloo", marks=pytest.mark.vllm_full),
        pytest.param("mixtral", 1, "zmq", marks=pytest.mark.vllm_full),
        pytest.param("mixtral", 0, "gloo", marks=pytest.mark.vllm_full),
        pytest.param("mixtral", 0, "zmq", marks=pytest.mark.vllm_full),
        pytest.param("mixtral", 0, "tcp", marks=pytest.mark.vllm_full),
        pytest.param("qwen2_moe", 1, "gloo", marks=pytest.mark.vllm_full),
    ],
)
def test_an_ffn_rank_killed_mid_generation_costs_no_request(
    checkpoints: Checkpoints, tmp_path: Path, arch: str, killed: int, transport: str
) -> None:
    """On either pair transport (``--transport``): the loss, the re-sends and the rejoin are the same."""
    model, plain = checkpoints.model(arch), checkpoints.plain(arch)
    port = free_port_block(4)
    flags = ("--expert-replicas", "2", "--transport", transport)
    serve = Serve(model, port, tmp_path / "serve.log", *flags, attention=1, ffn=2)
    try:
        ready_s = serve.wait_ready()
        pid = serve.role_pid(f"ffn {killed}")
        results, before, killed_at, answered_s = _kill_mid_generation(serve, model, pid)
        errors = [
            (i, status, events[-2:])
            for i, (status, events) in enumerate(results)
            if status != 200 or events[-1:] != ["[DONE]"] or any("error" in str(e).lower() for e in events)
        ]
        got = [streamed_greedy(events) for _, events in results]
        assert not errors, errors
        assert all(len(ids) == TOKENS for ids, _ in got), [len(ids) for ids, _ in got]
        versus_plain = compare(plain, got)
        log = serve.log_text()
        (line,) = [line for line in log.splitlines() if "its experts are served by" in line]
        failover = re.search(rf"afd-mrv2 failover: .*FFN rank {killed} lost .*\(at ([0-9.]+)\)", log)
        assert failover is not None, log[-3000:]
        assert f"[serve] transport: {transport} (every Attention-FFN pair)" in log, log[:3000]
        survivor = 1 - killed
        resent = f'afd_ffn_redispatched_total{{ffn="{survivor}"}}'
        metrics = _metrics_once_resent(serve, resent)
        status = json.loads(_get(serve.url + "/afd/status"))
        resend_at = status["figures"]["attention 0"]["failover"]["first_resend_at"][str(killed)]
        _assert_each_role_holds_its_own(status, survivor)
        after = [complete(serve.url, body(model, p, 8)) for p in prompts()[:4]]
        deadline = time.monotonic() + 600
        rejoined = _wait_for_rejoin(serve, model, killed, deadline)
        back = _metrics_once_rejoined_rank_serves(serve, model, killed, killed_at, deadline)
        restart_line = next(line for line in serve.log_text().splitlines() if "restarted: ready after" in line)
        print(
            f"\n[failover] {arch} 1A2F --expert-replicas 2 --transport {transport} ready after {ready_s:.1f} s; FFN rank {killed} (pid {pid}) "
            f"SIGKILLed mid-generation ({before} of {CLIENTS} requests finished before it): "
            f"{CLIENTS - len(errors)}/{CLIENTS} completed, 0 errors, answered within "
            f"{answered_s:.1f} s; kill -> failover {float(failover.group(1)) - killed_at:.3f} s, kill -> first "
            f"re-send {resend_at - killed_at:.3f} s, kill -> rejoin {float(rejoined.group(1)) - killed_at:.1f} s; "
            f"vs plain vLLM {versus_plain}\n[failover] {line}\n[failover] {restart_line}",
            flush=True,
        )
        assert versus_plain["identical"] >= CLIENTS - 1 and versus_plain["max_logprob_diff"] <= 1e-4, versus_plain
        assert line.startswith(f"[serve] ffn rank {killed} (pid {pid}) exited (signal SIGKILL)"), line
        assert line.endswith(f"FFN rank(s) {survivor} (1 of 2 live)"), line
        assert metric(metrics, "afd_ffn_ranks_live") == 1 and metric(metrics, "afd_ffn_failovers_total") == 1
        assert metric(metrics, 'afd_attention_failovers_total{engine="0"}') == 1, metrics
        assert (metric(metrics, resent) or 0) >= 1, metrics
        assert status["lost"]["ffn"] == [killed] and status["live"]["ffn"] == [survivor]
        assert 0 <= resend_at - killed_at < 10
        assert before < CLIENTS // 2, "the kill came too late to be mid-generation"
        assert all(code == 200 for code, _ in after), after
        assert serve.proc.poll() is None, "serve stopped"
        assert metric(back, "afd_ffn_ranks_live") == 2, back
        assert metric(back, f'afd_role_restarts_total{{rank="{killed}",role="ffn"}}') == 1, back
    finally:
        code = serve.stop()
    assert code == 0


def _assert_each_role_holds_its_own(status: dict[str, Any], survivor: int) -> None:
    """Issue 26 in /afd/status: the engine read and holds no expert; the survivor (R = 2 on 2 ranks) every one."""
    memory = status["figures"]["attention 0"]["memory"]
    assert memory["read_bytes"]["routed_experts"] == 0 and memory["resident_bytes"]["routed_experts"] == 0
    assert memory["resident_bytes"]["other"] > 0 and memory["peak_rss_bytes"] > 0, memory
    held = status["figures"][f"ffn {survivor}"]["memory"]["resident_bytes"]
    assert held["other"] == 0 and held["routed_experts"] > 0, held


def _errors(results: list[Any], tokens: int) -> list[Any]:
    """The requests that did not complete: not 200, no ``[DONE]``, an error event, or too few tokens."""
    bad = []
    for i, (status, events) in enumerate(results):
        text = "".join(e["choices"][0].get("text", "") for e in events if isinstance(e, dict) and e.get("choices"))
        if status != 200 or events[-1:] != ["[DONE]"] or any("error" in str(e).lower() for e in events) or not text:
            bad.append((i, status, events[-2:]))
    return bad


@pytest.mark.vllm_full
def test_1a3f_with_two_replicas_survives_the_loss_of_each_rank_in_turn(tmp_path: Path) -> None:
    """1A3F, ``--expert-replicas 2``, a mixtral checkpoint with 6 experts: each FFN rank in turn is SIGKILLed
    while 16 streamed requests generate, after the one before was restarted and taken back; no request
    sees an error, and each kill is followed by one failover and one rejoin."""
    model = tmp_path / "mixtral-6"
    cmd = [sys.executable, "-m", "afd_mrv2.cli", "make-model", str(model), "--arch", "mixtral", "--experts", "6"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    serve = Serve(model, free_port_block(4), tmp_path / "serve.log", "--expert-replicas", "2", attention=1, ffn=3)
    lines = []
    try:
        serve.wait_ready()
        for n, killed in enumerate((1, 0, 2), start=1):
            pid = serve.role_pid(f"ffn {killed}") if n == 1 else serve.role_pids()[f"ffn {killed}"]
            results, threads, first = _stream_all(serve.url, model, 16, 48)
            assert first.wait(300)
            time.sleep(0.3)
            killed_at = time.time()
            os.killpg(pid, signal.SIGKILL)
            for t in threads:
                t.join(600)
            assert not _errors(results, 48), _errors(results, 48)
            deadline = time.monotonic() + 600
            while serve.log_text().count("afd-mrv2 rejoin:") < n:
                assert time.monotonic() < deadline and serve.proc.poll() is None, serve.log_text()[-3000:]
                complete(serve.url, body(model, prompts()[0], 4))
                time.sleep(0.5)
            rejoin = [line for line in serve.log_text().splitlines() if "afd-mrv2 rejoin:" in line][-1]
            at = float(re.search(r"\(at ([0-9.]+)\)", rejoin).group(1))  # type: ignore[union-attr]
            lines.append(f"FFN rank {killed}: 16/16 completed, rejoined {at - killed_at:.1f} s after the kill")
        print("\n[failover] 1A3F R=2: " + "; ".join(lines), flush=True)
        assert serve.log_text().count("its experts are served by their other holders") == 3
    finally:
        code = serve.stop()
    assert code == 0


@pytest.mark.vllm_full
def test_micro_batched_steps_fail_over_too(tmp_path: Path, checkpoints: Checkpoints) -> None:
    """``--ubatches 2`` (Model Runner V2, two micro-batches, both with round trips in flight) at 1A2F with
    ``--expert-replicas 2``: FFN rank 1 killed mid-generation, every streamed request completes."""
    model = checkpoints.model("mixtral")
    flags = ["--expert-replicas", "2", *UBATCHED]
    serve = Serve(model, free_port_block(4), tmp_path / "serve.log", *flags, attention=1, ffn=2, env=v2_env())
    try:
        serve.wait_ready()
        results, threads, first = _stream_all(serve.url, model, CLIENTS, TOKENS)
        assert first.wait(300)
        time.sleep(0.3)
        os.killpg(serve.role_pid("ffn 1"), signal.SIGKILL)
        for t in threads:
            t.join(600)
        errors = _errors(results, TOKENS)
        resent = re.findall(r"afd-mrv2 failover: .*FFN rank 1 lost", serve.log_text())
        print(f"\n[failover] micro-batched 1A2F R=2: {CLIENTS - len(errors)}/{CLIENTS} completed", flush=True)
        assert not errors, errors
        assert len(resent) == 1
    finally:
        code = serve.stop()
    assert code == 0
