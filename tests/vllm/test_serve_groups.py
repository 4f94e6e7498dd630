"""M:N on real vLLM: ``afd-mrv2 serve --attention 2`` runs the two Attention ranks as the DP ranks of ONE vLLM
deployment, and each FFN rank computes each MoE layer once for both (docs/vllm.md, "Attention groups").

Mixtral-style checkpoint in fp32; plain vLLM (one engine, DP1 TP1, afd-mrv2 installed, no ``afd`` section)
answers the 32 greedy completions first.  Each layout answers the same 32 concurrently (16 clients at a time):

* DP2 with 1 FFN rank (the reduced matrix), DP2 with 2 FFN ranks (R = 2), DP2 on Model Runner V2 (the tests'
  Triton stand-in), DP1 TP2 and DP2 TP2 (each TP rank sends its share of the rows): 32/32 token-identical,
  max |dlogprob| <= 1e-4;
* the FFN ranks' reports (``afd-mrv2 ffn: done``): the group's ranks served the same number of items (lock-step),
  every expert computation took rows from both ranks or one (``ranks_per_call``), and there is at most one
  computation per MoE layer and step of the group (two independent engines would make two);
* an FFN rank killed mid-stream at DP2 2F R = 2: every request completes, identical;
* one DP rank's EngineCore SIGKILLed: every client has an answer or an error within 10 s, serve's line says
  the deployment restarts whole, it serves again (identical), and no process is left after stop.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2.harness.servers import ENGINE_ARGS
from afd_mrv2.procs import group_members
from tests.serve.conftest import free_port_block
from tests.vllm.harness import make_model, v2_env
from tests.vllm.serving import PlainServer, Serve, body, compare, ffn_reports, stream
from tests.vllm.test_serve_topologies import PROMPTS_32, TOKENS
from tests.vllm.test_serve_topologies import answers as _answers

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("groups-mixtral") / "model", "mixtral")


@pytest.fixture(scope="module")
def plain(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[list[int], list[float]]]:
    server = PlainServer(model, free_port_block(1), tmp_path_factory.mktemp("plain") / "plain.log")
    try:
        server.wait_ready()
        return _answers(server.url, model)
    finally:
        server.stop()


#: (label, DP ranks, TP ranks, FFN ranks, extra serve flags, V2 runner)
LAYOUTS = [
    pytest.param(("dp2-1f", 2, 1, 1, (), False), id="dp2-1f"),
    pytest.param(
        ("dp2-2f-r2", 2, 1, 2, ("--expert-replicas", "2"), False), id="dp2-2f-r2", marks=pytest.mark.vllm_full
    ),
    pytest.param(("dp2-1f-v2", 2, 1, 1, (), True), id="dp2-1f-v2", marks=pytest.mark.vllm_full),
    pytest.param(("dp1tp2-1f", 1, 2, 1, (), False), id="dp1tp2-1f", marks=pytest.mark.vllm_full),
    pytest.param(("dp2tp2-1f", 2, 2, 1, (), False), id="dp2tp2-1f", marks=pytest.mark.vllm_full),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_group_is_token_identical_to_plain_vllm_and_meets_in_one_expert_call_per_layer(
    layout: tuple[str, int, int, int, tuple[str, ...], bool], model: Path, plain: Any, tmp_path: Path
) -> None:
    label, dp, tp, ffn, flags, v2 = layout
    extra = [*ENGINE_ARGS, "--enforce-eager"] if v2 else None  # V2 with the Triton stand-in: no torch.compile
    serve = Serve(
        model,
        free_port_block(4),
        tmp_path / "serve.log",
        *flags,
        extra=extra,
        attention=dp,
        ffn=ffn,
        groups=1,
        tp=tp,
        env=v2_env() if v2 else None,
    )
    try:
        ready_s = serve.wait_ready()
        got = _answers(serve.url, model)
    finally:
        code = serve.stop()
    versus = compare(plain, got)
    reports = ffn_reports(serve.log_text())
    print(f"\n[{label}] ready after {ready_s:.1f} s; vs plain: {json.dumps(versus)}", flush=True)
    assert code == 0 and sorted(reports) == list(range(ffn)), serve.log_text()[-3000:]
    assert versus["identical"] == len(PROMPTS_32) and versus["max_logprob_diff"] <= 1e-4, versus
    ranks = dp * tp
    for rank, report in reports.items():
        per_rank = {int(a): n for a, n in report["items_per_attention"].items()}
        calls, mixed = report["expert_calls"], report["ranks_per_call"]
        layer_steps = per_rank[0]
        print(
            f"[{label}] ffn {rank}: items per rank {per_rank}, expert calls {calls} "
            f"({calls / layer_steps:.3f} per MoE layer and step), ranks_per_call {mixed}, "
            f"tokens per call {report['tokens_per_call']}",
            flush=True,
        )
        assert sorted(per_rank) == list(range(ranks)) and len(set(per_rank.values())) == 1, per_rank  # lock-step
        assert calls <= layer_steps  # one computation per layer and step for the whole group, at most
        assert mixed.get(str(ranks), 0) > 0, mixed  # rows of every rank met in one computation
        assert sum(mixed.values()) == calls


@pytest.mark.vllm_full
def test_an_ffn_rank_killed_mid_stream_at_dp2_2f_r2_costs_no_request(model: Path, plain: Any, tmp_path: Path) -> None:
    serve = Serve(
        model, free_port_block(4), tmp_path / "serve.log", "--expert-replicas", "2", attention=2, ffn=2, groups=1
    )
    try:
        serve.wait_ready()
        bodies = [body(model, p, TOKENS, logprobs=1, return_token_ids=True) for p in PROMPTS_32]
        results: list[Any] = [None] * len(bodies)
        first = threading.Event()

        def client(i: int) -> None:
            results[i] = stream(serve.url, bodies[i], first=first)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(bodies))]
        for t in threads:
            t.start()
        assert first.wait(300)
        time.sleep(0.3)
        os.killpg(serve.role_pid("ffn 1"), signal.SIGKILL)
        for t in threads:
            t.join(600)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        got = [_streamed(r) for r in results]
    finally:
        serve.stop()
    versus = compare(plain, got)
    print(f"\n[dp2-2f-r2, ffn 1 killed] vs plain: {json.dumps(versus)}", flush=True)
    assert versus["identical"] == len(PROMPTS_32) and versus["max_logprob_diff"] <= 1e-4, versus
    assert "its experts are served by their other holders" in serve.log_text()


def _streamed(result: Any) -> tuple[list[int], list[float]]:
    status, events = result
    assert status == 200 and events and events[-1] == "[DONE]", result
    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    ids: list[int] = []
    logprobs: list[float] = []
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            ids += choice.get("token_ids") or []
            logprobs += [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    return ids, logprobs


@pytest.mark.vllm_full
def test_a_dp_rank_killed_ends_its_deployment_which_serve_restarts_whole(
    model: Path, plain: Any, tmp_path: Path
) -> None:
    serve = Serve(model, free_port_block(4), tmp_path / "serve.log", attention=2, ffn=1, groups=1)
    try:
        serve.wait_ready()
        leader = serve.role_pid("attention 0")
        bodies = [body(model, p, 200) for p in PROMPTS_32[:8]]
        results: list[Any] = [None] * len(bodies)
        finished: list[float] = [0.0] * len(bodies)
        first = threading.Event()

        def client(i: int) -> None:
            results[i] = stream(serve.url, bodies[i], first=first)
            finished[i] = time.monotonic()

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(bodies))]
        for t in threads:
            t.start()
        assert first.wait(300)
        time.sleep(0.5)
        members = group_members(leader) or {}
        (dp1,) = [pid for pid, name in members.items() if name.startswith("VLLM::EngineCor") and "DP1" in _cmdline(pid)]
        killed = time.monotonic()
        os.kill(dp1, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        answered = max(finished) - killed
        print(f"\n[dp2 rank 1 killed] every client answered (an error) within {answered:.2f} s", flush=True)
        assert answered <= 10.0
        assert all(status != 200 or "error" in json.dumps(events[-3:]) for status, events in results), results
        deadline = time.monotonic() + 600
        while "restarted: ready after" not in serve.log_text():
            assert time.monotonic() < deadline and serve.proc.poll() is None, serve.log_text()[-3000:]
            time.sleep(1.0)
        line = next(line for line in serve.log_text().splitlines() if "its vLLM deployment restarts whole" in line)
        print(f"[dp2 rank 1 killed] {line}", flush=True)
        versus = compare(plain, _answers(serve.url, model))
        assert versus["identical"] == len(PROMPTS_32), versus
        new_leader = serve.role_pid("attention 0")
    finally:
        code = serve.stop()
    assert code == 0
    assert not group_members(leader) and not group_members(new_leader), "a process of the group outlived serve"


def _cmdline(pid: int) -> str:
    """A process's command line as vLLM titled it (``VLLM::EngineCore_DP1``), empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
