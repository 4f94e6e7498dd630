"""``afd-mrv2 serve MODEL --attention 1 --ffn 1`` on real vLLM, against plain vLLM's OpenAI server.

Run (deselected by default)::

    scripts/setup_vllm_cpu.sh
    .venv-vllm/bin/python -m pytest -m vllm_runtime tests/vllm/test_serve.py -x -s

One ``afd-mrv2 make-model`` mixtral checkpoint; plain vLLM's OpenAI server on it
(plugin installed, no ``afd`` section) answers 16 greedy completions and stops;
then one ``afd-mrv2 serve`` (FFN role + Attention engine, each on its own core) is
shared by the tests of this module (module scope), stopped with SIGTERM by the last.
The faults, each with a serve of its own, are in test_serve_faults.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import free_port_block
from tests.vllm.engine import PROMPTS
from tests.vllm.harness import make_model
from tests.vllm.serving import (
    READY,
    PlainServer,
    Serve,
    body,
    compare,
    complete,
    complete_all,
    ffn_reports,
    greedy,
    stream,
)

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(1200)]

MAX_TOKENS = 12


def _greedy_payloads(model: Path) -> list[dict[str, Any]]:
    return [body(model, p, MAX_TOKENS, logprobs=1, return_token_ids=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("serve-mixtral") / "model", "mixtral")


@pytest.fixture(scope="module")
def plain(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plain vLLM's answers to the 16 greedy prompts (sent concurrently), then the server is stopped."""
    server = PlainServer(model, free_port_block(1), tmp_path_factory.mktemp("plain") / "plain.log")
    try:
        ready_s = server.wait_ready()
        answers = complete_all(server.url, _greedy_payloads(model))
    finally:
        server.stop()
    assert all(status == 200 for status, _ in answers), answers
    return {"ready_s": ready_s, "results": [greedy(a) for _, a in answers]}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(model: Path, plain: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """One ``afd-mrv2 serve`` for the module (started after plain vLLM stopped: two cores, two roles)."""
    serve = Serve(model, free_port_block(3), tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        serve.ready_s = serve.wait_ready()  # type: ignore[attr-defined]
        print(f"\n[serve] ready after {serve.ready_s:.1f} s (plain vLLM: {plain['ready_s']:.1f} s)", flush=True)  # type: ignore[attr-defined]
        yield serve
    finally:
        serve.stop()


def test_ready_line_once_and_roles_pinned_apart(served: Serve) -> None:
    assert served.stdout == [f"{READY} {served.url}/v1"]
    log = served.log_text()
    # the FFN rank started, was ready, then the Attention engine started
    assert log.index("[ffn 0] afd-mrv2 ffn: ready") < log.index("[attention 0] started pid")
    binds = {
        line.split("VLLM_CPU_OMP_THREADS_BIND=")[1].split(",")[0]
        for line in log.splitlines()
        if "VLLM_CPU_OMP_THREADS_BIND=" in line
    }
    assert len(binds) == 2, binds  # one core set per role


def test_greedy_completions_through_serve_equal_plain_vllm(served: Serve, model: Path, plain: dict[str, Any]) -> None:
    start = time.monotonic()
    answers = complete_all(served.url, _greedy_payloads(model))
    took = time.monotonic() - start
    assert all(status == 200 for status, _ in answers), answers
    result = compare(plain["results"], [greedy(a) for _, a in answers])  # type: ignore[arg-type]
    print(
        f"\n[serve] 16 concurrent greedy completions in {took:.1f} s; vs plain vLLM: {json.dumps(result)}", flush=True
    )
    assert result["identical"] == result["completions"] == len(PROMPTS), result
    assert result["max_logprob_diff"] <= 1e-5, result


def test_stream_passes_through_and_matches_the_plain_answer(served: Serve, model: Path) -> None:
    payload = body(model, PROMPTS[0], MAX_TOKENS)
    status, whole = complete(served.url, payload)
    assert status == 200, whole
    start = time.monotonic()
    status, events = stream(served.url, payload)
    took = time.monotonic() - start
    assert status == 200, events
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    text = "".join(e["choices"][0]["text"] for e in chunks)
    print(
        f"\n[serve] stream: {len(chunks)} events in {took:.2f} s, text == non-streamed: {text == whole['choices'][0]['text']}",
        flush=True,
    )  # type: ignore[index]
    assert len(chunks) >= MAX_TOKENS // 2  # token by token, not one buffered body
    assert text == whole["choices"][0]["text"]  # type: ignore[index]


def test_16_concurrent_clients_all_succeed(served: Serve, model: Path) -> None:
    """Eight streamed and eight plain clients at once, 32 tokens each."""
    results: list[Any] = [None] * 16

    def client(i: int) -> None:
        payload = body(model, PROMPTS[i], 32)
        results[i] = stream(served.url, payload) if i % 2 else complete(served.url, payload)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    took = time.monotonic() - start
    ok = 0
    for i, (status, answer) in enumerate(results):
        assert status == 200, (i, answer)
        if i % 2:
            assert answer[-1] == "[DONE]", (i, answer[-3:])
        else:
            assert answer["usage"]["completion_tokens"] == 32, (i, answer)
        ok += 1
    print(
        f"\n[serve] 16 concurrent clients (8 streamed): {ok}/16 succeeded in {took:.1f} s, {16 * 32 / took:.0f} output tokens/s",
        flush=True,
    )


def _stream_and_hang_up_after_done(url: str, payload: dict[str, Any]) -> bool:
    """A streamed completion whose client closes its socket as soon as it read ``data: [DONE]`` (what many
    clients do), before the response's last chunk; True once [DONE] was seen."""
    parsed = urllib.parse.urlsplit(url)
    body_bytes = json.dumps({**payload, "stream": True}).encode()
    with socket.create_connection((parsed.hostname, parsed.port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body_bytes)}\r\n\r\n".encode()
            + body_bytes
        )
        seen = b""
        while b"data: [DONE]" not in seen:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            seen += chunk
    return True


def test_clients_that_hang_up_after_done_leave_no_traceback(served: Serve, model: Path) -> None:
    done = [_stream_and_hang_up_after_done(served.url, body(model, PROMPTS[i], 8)) for i in range(10)]
    time.sleep(1.0)  # the proxy's write of the last chunk fails after the client left
    assert done == [True] * 10
    status, _ = complete(served.url, body(model, PROMPTS[0], 4))
    assert status == 200  # serving goes on
    log = served.log_text()
    assert "Traceback" not in log and "ClientConnectionResetError" not in log, log[-3000:]


def test_metrics_carry_the_engines_vllm_metrics_by_attention_rank_and_the_afd_ones(served: Serve) -> None:
    """``GET /metrics`` on the endpoint: the real engine's ``vllm:*`` families with ``engine="0"`` (its
    Attention rank), serve's AFD gauges, and one ``# TYPE`` line per family (valid for Prometheus)."""
    with urllib.request.urlopen(served.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    found = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    vllm_engines = {dict(labels).get("engine") for (name, labels) in found if name.startswith("vllm:")}
    assert vllm_engines == {"0"}, sorted(vllm_engines, key=str)
    assert any(name == "vllm:num_requests_running" for name, _ in found)
    assert found[("afd_ffn_ranks_live", ())] == 1 and found[("afd_attention_ranks_live", ())] == 1
    assert found[("afd_engine_scrape_ok", (("engine", "0"),))] == 1
    with urllib.request.urlopen(served.url + "/afd/status", timeout=30) as resp:
        status = json.loads(resp.read())
    assert status["live"] == {"attention": [0], "ffn": [0]} and status["ready"] is True
    # every role's figures come through the store, current while idle: published within the last 1.5 s
    time.sleep(2.0)  # no request runs now
    with urllib.request.urlopen(served.url + "/afd/status", timeout=30) as resp:
        idle = json.loads(resp.read())
    now = time.time()
    for role in ("attention 0", "ffn 0"):
        assert now - idle["figures"][role]["at"] <= 1.5 + 0.5, (role, now, idle["figures"][role])
    assert idle["figures"]["attention 0"]["calls"] > 0 and idle["figures"]["ffn 0"]["items"] > 0, idle["figures"]


def test_sigterm_stops_serve_within_10s(served: Serve) -> None:
    start = time.monotonic()
    code = served.stop()
    took = time.monotonic() - start
    print(f"\n[serve] SIGTERM -> exit {code} after {took:.1f} s", flush=True)
    assert code == 0, served.log_text()[-3000:]
    assert took < 10
    assert served.stdout == [f"{READY} {served.url}/v1"]  # exactly one stdout line, ever
    # AFD was live: the FFN served the Attention engine's MoE calls until it left, at a step boundary: a
    # normal stop is a normal end in its report, not an error
    (report,) = ffn_reports(served.log_text()).values()
    assert report["end"].startswith("left between steps: attention rank 0 closed its connection"), report["end"]
    assert "Traceback" not in served.log_text()
    served_items = report["items"]
    print(
        f"[serve] the FFN served {served_items} work items (MoE layer calls) before the Attention engine left",
        flush=True,
    )
    assert served_items >= 2 * MAX_TOKENS  # at least the decode steps of one greedy completion, 2 MoE layers each
