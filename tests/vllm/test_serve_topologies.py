"""``afd-mrv2 serve`` with one or several Attention engines and FFN ranks (1A1F, 2A1F, 2A2F, 1A2F, 1A3F) on real
vLLM.

Mixtral-style checkpoint, V1 CPU runner, 2A1F serialized, 2A2F with ``--depth auto``
(multistream on every role) and 1A2F serialized (more FFN ranks than Attention engines: a
free topology, the experts sharded over both FFN ranks), 1A1F and 1A3F (8 experts on 3 FFN ranks: E not
divisible by F, balanced blocks of 3, 3 and 2); plain vLLM (afd-mrv2 installed, no ``afd``
section) answers the same 32 greedy completions of 16 tokens twice (the plain-vs-plain
figure), each topology once, all sent concurrently.  The proxy spreads the requests over
two independent engines, so their batches differ from plain vLLM's single engine: the
issue's bound is >= 31/32 token-identical with max |logprob diff| <= 1e-4.

From inside the processes (vLLM's ``collective_rpc``, over HTTP with
``VLLM_SERVER_DEV_MODE=1``; the FFN ranks' ``afd-mrv2 ffn: done`` reports):

* each Attention engine holds 0 routed-expert parameter bytes; the FFN ranks together
  hold exactly plain vLLM's (each rank its share of the experts, read and allocated alone: its memory
  figures say so, with no other parameter byte and one KV block, the scheduler's null block);
* every FFN rank served exactly (MoE layers x forwards) items of every Attention engine:
  the engine's own count of routed-expert calls, warm-up included;
* with 2A, both engines served requests (the proxy balances), each on its own clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serve.conftest import free_port_block
from tests.vllm.engine import PROMPTS
from tests.vllm.harness import make_model
from tests.vllm.serving import DEV_MODE, PlainServer, Serve, body, compare, complete_all, ffn_reports, greedy, rpc

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1800)]

#: (Attention engines, FFN ranks, serve's --depth): 2A2F runs multistream with depth auto on every
#: role (what grants ``multistream_ffn`` on the CPU test vehicle), 2A1F serialized (the default),
#: 1A2F serialized (F > A: no rank pairing, every FFN rank serves the one engine)
TOPOLOGIES = [(2, 1, None), (2, 2, "auto"), (1, 2, None), (1, 1, None), (1, 3, None)]
TOKENS = 16
#: 32 prompts: the 16 of tests/vllm/engine.py and each once more with a suffix
PROMPTS_32 = [*PROMPTS, *(f"{p} and then" for p in PROMPTS)]

Answers = list[tuple[list[int], list[float]]]


def answers(url: str, model: Path) -> Answers:
    payloads = [body(model, p, TOKENS, logprobs=1, return_token_ids=True) for p in PROMPTS_32]
    got = complete_all(url, payloads)
    assert all(status == 200 for status, _ in got), got
    return [greedy(a) for _, a in got]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("topologies-mixtral") / "model", "mixtral")


@pytest.fixture(scope="module")
def plain(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    server = PlainServer(
        model,
        free_port_block(1),
        tmp_path_factory.mktemp("plain") / "plain.log",
        "--worker-extension-cls",
        "afd_mrv2.mrv2.extension.AfdWorkerExtension",
        env=DEV_MODE,
    )
    try:
        server.wait_ready()
        first, again = answers(server.url, model), answers(server.url, model)
        (expert_bytes,) = rpc(server.url, "afd_routed_expert_bytes")  # vLLM's endpoint sends scalars as text
    finally:
        server.stop()
    return {"answers": first, "again": again, "routed_expert_bytes": int(expert_bytes)}


@pytest.fixture(
    scope="module", params=TOPOLOGIES, ids=[f"{a}A{f}F" + (f"-depth-{d}" if d else "") for a, f, d in TOPOLOGIES]
)
def served(
    request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    a, f, depth = request.param
    port = free_port_block(a + 4)
    log = tmp_path_factory.mktemp(f"serve-{a}a{f}f") / "serve.log"
    args = ("--depth", depth) if depth else ()
    serve = Serve(model, port, log, *args, attention=a, ffn=f, env=DEV_MODE)
    try:
        ready_s = serve.wait_ready()
        got = answers(serve.url, model)
        engines = [f"http://127.0.0.1:{port + 1 + rank}" for rank in range(a)]
        stats = [rpc(url, "afd_attention_stats")[0] for url in engines]
        attention_bytes = [int(rpc(url, "afd_routed_expert_bytes")[0]) for url in engines]
    finally:
        code = serve.stop()
    reports = ffn_reports(serve.log_text())
    yield {
        "topology": (a, f),
        "depth": depth,
        "ready_s": ready_s,
        "answers": got,
        "stats": stats,
        "attention_bytes": attention_bytes,
        "ffn": reports,
        "stop_code": code,
    }


def test_token_identical_to_plain_vllm_within_the_bound(served: dict[str, Any], plain: dict[str, Any]) -> None:
    a, f = served["topology"]
    versus_plain = compare(plain["answers"], served["answers"])
    plain_again = compare(plain["answers"], plain["again"])
    print(
        f"\n[{a}A{f}F] ready after {served['ready_s']:.1f} s; vs plain: {json.dumps(versus_plain)}; "
        f"plain vs plain: {json.dumps(plain_again)}",
        flush=True,
    )
    assert plain_again["identical"] == len(PROMPTS_32)
    assert versus_plain["identical"] >= len(PROMPTS_32) - 1
    assert versus_plain["max_logprob_diff"] <= 1e-4


def test_from_inside_weights_live_only_on_the_ffn_ranks_and_every_item_was_served(
    served: dict[str, Any], plain: dict[str, Any]
) -> None:
    a, f = served["topology"]
    reports, stats = served["ffn"], served["stats"]
    print(f"\n[{a}A{f}F] attention stats {json.dumps(stats)}\n[{a}A{f}F] ffn reports {json.dumps(reports)}", flush=True)
    assert served["stop_code"] == 0
    assert served["attention_bytes"] == [0] * a
    assert sorted(reports) == list(range(f)), "every FFN rank ends its session and reports"
    assert sum(r["routed_expert_bytes"] for r in reports.values()) == plain["routed_expert_bytes"]
    for rank, report in reports.items():
        memory = report["memory"]
        held = report["routed_expert_bytes"]
        assert report["model_class"] == "AfdFfnExperts" and report["kv_cache_blocks"] == 1, (rank, report)
        assert memory["resident_bytes"] == {"routed_experts": held, "other": 0}, (rank, memory)
        assert memory["read_bytes"]["routed_experts"] == held, (rank, memory)
        served_items = {int(k): n for k, n in report["items_per_attention"].items()}
        assert served_items == {i: stats[i]["calls"] for i in range(a)}, (rank, served_items)
        pipelined = {info["pipelined"] for info in report["executors"].values()}
        assert pipelined == {served["depth"] is not None}, (rank, report["executors"])
    moe_layers = len(stats[0]["moe_layers"])
    for s in stats:
        assert s["calls"] % moe_layers == 0 and s["calls"] > moe_layers  # warm-up plus requests, whole forwards
