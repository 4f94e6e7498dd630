"""Negative control: a connector that drops one MoE layer's result must break the equivalence with plain vLLM.

Run (deselected by default)::

    .venv-vllm/bin/python -m pytest -m vllm_runtime tests/vllm/test_negative_control.py -x -s

The equivalence tests (test_serve.py, test_afd_in_vllm.py, test_qwen2_moe.py) claim
that AFD through torch_p2p gives plain vLLM's tokens and logprobs.  That claim is
worth something only if a transfer that loses data fails it.  ``drop_layer``
(tests/vllm/thirdparty/afd_mrv2_test_drop.py, TEST ONLY) is torch_p2p except that
the Attention side hands the model zeros instead of the combined routed-experts
output of MoE layer ordinal 1; every item still makes its full round trip.

It is installed the way any third party installs a connector, and only for this
test: a temporary site folder holds the module and an
``afd_mrv2_test_drop-0.0.0.dist-info`` (METADATA, entry_points.txt with
``[afd_mrv2] drop_layer = afd_mrv2_test_drop:DropLayerConnector``); ``afd-mrv2
serve --connector drop_layer`` gets that folder on ``PYTHONPATH`` and its roles
inherit it.  afd-mrv2's own entry points never name it.

One mixtral checkpoint; one 1A1F serve with ``drop_layer`` and plain vLLM's OpenAI
server (which runs while serve's FFN role starts) answer the 16 greedy prompts (module scope).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2.plugins import entry_points
from tests.serve.conftest import free_port_block
from tests.vllm.harness import make_model
from tests.vllm.serving import PlainServer, Serve, compare, greedy_answers, third_party_site, with_site

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.vllm_full, pytest.mark.timeout(1200)]

CONNECTOR = "drop_layer"
MARK = "afd_mrv2_test_drop:"  # afd_mrv2_test_drop.MARK: every line the connector prints
DROPPED = re.compile(r"afd_mrv2_test_drop: dropped layer=(\d+) .* drops=(\d+)")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("negative-mixtral") / "model", "mixtral")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return third_party_site(
        tmp_path_factory.mktemp("thirdparty") / "site", "afd_mrv2_test_drop", CONNECTOR, "DropLayerConnector"
    )


@pytest.fixture(scope="module")
def answers(model: Path, site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plain vLLM's and ``afd-mrv2 serve --connector drop_layer``'s answers to the 16 greedy prompts, and serve's log.

    serve starts first (the site on its PYTHONPATH); plain vLLM (core 0) runs while serve's roles
    start (its FFN role on core 1 first, then its Attention engine on core 0), which saves ~30 s of CI.
    """
    folder = tmp_path_factory.mktemp("negative")
    site_path = with_site(site)
    serve = Serve(model, free_port_block(3), folder / "serve.log", "--connector", CONNECTOR, env=site_path)
    try:
        server = PlainServer(model, free_port_block(1), folder / "plain.log")
        try:
            server.wait_ready()
            plain = greedy_answers(server.url, model)
        finally:
            server.stop()
        serve.wait_ready()
        dropped = greedy_answers(serve.url, model)
    finally:
        code = serve.stop()
    return {"plain": plain, "dropped": dropped, "log": serve.log_text(), "exit": code}


def test_drop_layer_is_no_connector_of_afd_mrv2_and_serve_refuses_it_without_the_site(model: Path, site: Path) -> None:
    assert CONNECTOR not in entry_points()  # not shipped: afd-mrv2's entry points do not name it
    exe = Path(sys.executable).with_name("afd-mrv2")
    cmd = [str(exe), "serve", str(model), "--attention", "1", "--ffn", "1", "--port", str(free_port_block(3))]
    refused = subprocess.run([*cmd, "--connector", CONNECTOR], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert f"afd.connector: {CONNECTOR!r} is not installed" in refused.stderr, refused.stderr
    # with the site folder on PYTHONPATH the entry point is found and loads as a connector
    probe = "from afd_mrv2.plugins import installed; print(installed()[" + repr(CONNECTOR) + "])"
    found = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **with_site(site)},
    )
    assert found.stdout.strip() == "connector", found.stdout + found.stderr


def test_dropping_one_moe_layer_breaks_the_equivalence_with_plain_vllm(answers: dict[str, Any]) -> None:
    result = compare(answers["plain"], answers["dropped"])
    lines = [line for line in answers["log"].splitlines() if MARK in line]
    drops = [(line.split("]", 1)[0] + "]", *map(int, m.groups())) for line in lines if (m := DROPPED.search(line))]
    print(
        f"\n[negative control] drop_layer vs plain vLLM: {json.dumps(result)}; "
        f"{len(drops)} items of MoE layer 1 dropped on the Attention side (none of layer 0: "
        f"{all(layer == 1 for _, layer, _ in drops)}); serve exit {answers['exit']}",
        flush=True,
    )
    # the connector ran in both roles, from the third-party distribution
    assert any(line.startswith("[attention 0]") and "drops MoE layer 1" in line for line in lines), lines[:5]
    assert any(line.startswith("[ffn 0]") and "unchanged torch_p2p" in line for line in lines), lines[:5]
    # it dropped only layer 1, once per forward: at least one per generated token (12), plus the warm-up
    assert drops and all(role == "[attention 0]" and layer == 1 for role, layer, _ in drops), drops[:5]
    assert [n for _, _, n in drops] == list(range(1, len(drops) + 1))
    assert len(drops) >= 12, drops
    # and the equivalence check fails: not every completion is plain vLLM's
    assert result["identical"] < result["completions"] == 16, result
    assert result["differing"] > 0, result
    assert answers["exit"] == 0
