"""tests/vllm's view of the one serving harness (afd_mrv2.harness, through scripts/serving): real ``afd-mrv2 serve`` and plain
vLLM OpenAI servers with the tests' defaults, and what only the tests need.

* :class:`Serve`: ``afd-mrv2 serve MODEL --attention 1 --ffn 1 --port P [FLAGS] -- ENGINE ARGS``;
* :class:`PlainServer`: plain vLLM's OpenAI server on the same checkpoint and engine arguments,
  pinned to the first core;
* :func:`greedy_answers`: the 16 greedy prompts at once, as :func:`compare` takes them;
* :func:`third_party_site` / :func:`with_site`: a test-only plugin installed as its own distribution.

Both servers get :data:`ENGINE_ARGS` (fp32) unless told otherwise.  A server that does not become
ready fails the test with its log's tail (an ``AssertionError``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

# re-exported for the tests: DEV_MODE, READY, complete, compare, stream, rpc
from scripts.serving import (  # noqa: F401 - re-exported for the tests (see the comment above)
    DEV_MODE,
    ENGINE_ARGS,
    READY,
    START_TIMEOUT_S,
    ServerError,
    ServeServer,
    ServeTopology,
    body,
    compare,
    complete,
    complete_all,
    greedy,
    stream,
)
from scripts.serving import PlainServer as HarnessPlainServer
from scripts.serving import collective_rpc as rpc  # noqa: F401 - re-exported for the tests
from scripts.serving import ffn_reports as harness_ffn_reports
from tests.dists import write_dist_info
from tests.vllm.engine import PROMPTS
from tests.vllm.harness import cores

#: the tests' serve waits less long than the scripts' (a CI run is bounded)
TEST_START_TIMEOUT_S = min(START_TIMEOUT_S, 600)


def _ready(server: Any, timeout_s: float) -> float:
    try:
        return float(server.wait_ready(timeout_s))
    except ServerError as exc:
        raise AssertionError(f"{exc}\n{server.log_text()[-4000:]}") from None


class Serve(ServeServer):
    """``afd-mrv2 serve`` as a child process group, with the tests' engine arguments."""

    def __init__(
        self,
        model: Path,
        port: int,
        log: Path,
        *flags: str,
        extra: list[str] | None = None,
        attention: int = 1,
        ffn: int = 1,
        env: dict[str, str] | None = None,
        groups: int | None = None,
        tp: int = 1,
    ) -> None:
        topology = ServeTopology(attention, ffn, flags=flags, groups=groups, tp=tp)
        super().__init__(model, port, log, topology, ENGINE_ARGS if extra is None else extra, env)

    def wait_ready(self, timeout_s: float = TEST_START_TIMEOUT_S) -> float:
        """Seconds from the start to the ready line; an ``AssertionError`` with the log's tail if it does not come."""
        return _ready(super(), timeout_s)


class PlainServer(HarnessPlainServer):
    """Plain vLLM's OpenAI server (afd-mrv2 installed, no ``afd`` section) on the first core."""

    def __init__(self, model: Path, port: int, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(model, port, log, [*ENGINE_ARGS, *args], cores()[0], env)

    def wait_ready(self, timeout_s: float = TEST_START_TIMEOUT_S) -> float:
        return _ready(super(), timeout_s)


THIRD_PARTY = Path(__file__).with_name("thirdparty")


def third_party_site(folder: Path, module: str, connector: str, factory: str) -> Path:
    """A site folder holding a TEST-ONLY distribution, installed the way any third party installs a connector:
    ``tests/vllm/thirdparty/<module>.py`` and its dist-info declaring ``[afd_mrv2] connector = module:factory``."""
    folder.mkdir(parents=True)
    shutil.copy(THIRD_PARTY / f"{module}.py", folder / f"{module}.py")
    write_dist_info(folder, module, "0.0.0", {"afd_mrv2": {connector: f"{module}:{factory}"}})
    return folder


def with_site(site: Path) -> dict[str, str]:
    """The ``PYTHONPATH`` of this environment with ``site`` first (for a child's environment)."""
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def ffn_reports(log_text: str) -> dict[int, dict[str, Any]]:
    """Each FFN rank's ``afd-mrv2 ffn: done {...}`` report, from serve's log (rank -> report)."""
    return {done.rank: done.report for done in harness_ffn_reports(log_text)}


def greedy_payloads(model: Path, max_tokens: int = 12) -> list[dict[str, Any]]:
    """One greedy request per prompt of tests/vllm/engine.py, asking for what :func:`greedy` reads."""
    return [body(model, p, max_tokens, logprobs=1, return_token_ids=True) for p in PROMPTS]


def greedy_answers(url: str, model: Path, max_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    """:func:`greedy_payloads` sent concurrently to ``url``; every answer must be a 200."""
    answers = complete_all(url, greedy_payloads(model, max_tokens))
    assert all(status == 200 for status, _ in answers), answers
    return [greedy(a) for _, a in answers]  # type: ignore[arg-type]
