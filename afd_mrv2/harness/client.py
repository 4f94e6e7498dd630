"""An OpenAI-completions client for checking one endpoint against another (stdlib only).

* :func:`body`: a greedy request that generates exactly ``max_tokens`` (``ignore_eos``);
* :func:`complete`: ``POST /v1/completions``; an error is a status, never an exception
  or a hang (status -1 when the connection failed or was cut); :func:`stream`: the same,
  streamed, as the ``data:`` events; :func:`complete_all` / :func:`run_requests`: many at once;
* :func:`greedy`: token ids and logprobs of an answer; :func:`compare`: two lists of them, side by side;
* :data:`PROMPTS` / :func:`prompts`: the fixed prompts the equivalence checks send;
* :func:`collective_rpc` / :func:`engine_steps`: a vLLM server's ``POST /collective_rpc`` (needs
  :data:`DEV_MODE`) and its engine-step count (``vllm:iteration_tokens_total``, ``GET /metrics``);
* :class:`LineReader`: a child process's output lines, waitable (``afd-mrv2 serve``'s
  one stdout line says when it is ready).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .host import ServerError

REQUEST_TIMEOUT_S = 600
#: vLLM's histogram of tokens per engine step: its count is the engine's step count.
STEPS_METRIC = "vllm:iteration_tokens_total_count{"
#: vLLM's dev endpoints (``POST /collective_rpc``): what the tests and the bench read from inside the workers.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


#: One greedy completion: its token ids and their logprobs.
Greedy = tuple[list[int], list[float]]

#: The fixed prompts of the equivalence checks (short: the tiny checkpoints' tokenizers are small).
PROMPTS = (
    "the quick brown fox",
    "hello world",
    "one two three",
    "mixture of experts",
    "this is a tiny model",
    "seven eight nine",
    "routes tokens to",
    "the lazy dog",
    "attention ffn",
    "four five six",
    "quick brown",
    "over the lazy",
    "tiny model for",
    "experts routes",
    "hello",
    "ten nine eight seven",
)


def prompts(n: int) -> list[str]:
    """``n`` prompts: :data:`PROMPTS`, then numbered variants so every request differs."""
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" {i}") for i in range(n)]


def body(model: str | Path, prompt: str, max_tokens: int, **more: Any) -> dict[str, Any]:
    """A greedy completion request that generates exactly ``max_tokens`` tokens."""
    return {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **more,
    }


def complete(url: str, payload: dict[str, Any], timeout: float = 300) -> tuple[int, dict[str, Any] | str]:
    """POST ``url``/v1/completions; (status, JSON body), or (status, text) for a non-JSON or cut-short
    body, or (-1, reason) when the connection failed."""
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:  # connection cut: an error too, never a hang
        return -1, f"{type(exc).__name__}: {exc}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def greedy(response: dict[str, Any]) -> Greedy:
    """Token ids and their logprobs of a completion asked with ``logprobs: 1, return_token_ids: true``."""
    choice = response["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


def compare(a: list[Greedy], b: list[Greedy]) -> dict[str, Any]:
    """Identical completions, differing tokens (position by position, plus any length difference)
    and the largest |logprob| difference over the tokens of the identical completions."""
    pairs = list(zip(a, b, strict=True))
    identical = sum(x[0] == y[0] for x, y in pairs)
    differing = sum(
        sum(t != u for t, u in zip(x[0], y[0], strict=False)) + abs(len(x[0]) - len(y[0])) for x, y in pairs
    )
    diffs = [abs(p - q) for x, y in pairs if x[0] == y[0] for p, q in zip(x[1], y[1], strict=True)]
    return {
        "completions": len(a),
        "identical": identical,
        "tokens": sum(len(x[0]) for x in a),
        "differing": differing,
        "max_logprob_diff": max(diffs, default=float("nan")),
    }


class LineReader:
    """Every line a child process writes to ``pipe`` (text mode), collected by a daemon thread."""

    def __init__(self, pipe: IO[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, prefix: str, *, deadline: float, alive: Callable[[], bool]) -> bool:
        """True once a line starts with ``prefix``; False when ``alive()`` turned false or
        ``time.monotonic()`` passed ``deadline`` first."""
        with self._changed:
            while not any(line.startswith(prefix) for line in self.lines):
                if not alive() or time.monotonic() > deadline:
                    return False
                self._changed.wait(1.0)
        return True


@dataclass
class Round:
    """R requests answered by C concurrent clients."""

    wall_s: float
    answers: list[tuple[int, dict[str, Any] | str]]

    @property
    def failures(self) -> list[str]:
        return [f"{status}: {str(a)[:200]}" for status, a in self.answers if status != 200 or not isinstance(a, dict)]

    @property
    def output_tokens(self) -> int:
        return sum(int(a["usage"]["completion_tokens"]) for s, a in self.answers if s == 200 and isinstance(a, dict))

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_requests(url: str, payloads: list[dict[str, Any]], clients: int) -> Round:
    """Send ``payloads`` from ``clients`` concurrent client threads; wall time from the first send to the last answer."""
    with ThreadPoolExecutor(max(1, min(clients, len(payloads)))) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda p: complete(url, p, REQUEST_TIMEOUT_S), payloads))
        wall = time.perf_counter() - start
    return Round(wall, answers)


def collective_rpc(url: str, method: str, timeout: float = 120) -> list[Any]:
    """``collective_rpc(method)`` on the vLLM OpenAI server at ``url`` (started with ``VLLM_SERVER_DEV_MODE=1``):
    one result per worker."""
    req = urllib.request.Request(
        url + "/collective_rpc", json.dumps({"method": method}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return list(json.loads(resp.read())["results"])
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise ServerError(f"{url}/collective_rpc {method}: {exc}") from None


def engine_steps(url: str, timeout: float = 60) -> int | None:
    """The engine steps vLLM's server at ``url`` counted (``vllm:iteration_tokens_total_count`` summed over its
    engines, ``GET /metrics``); None when the metric is missing."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(STEPS_METRIC)]
    return int(sum(counts)) if counts else None


def stream(
    url: str, payload: dict[str, Any], timeout: float = 300, first: threading.Event | None = None
) -> tuple[int, list[Any]]:
    """POST a ``"stream": true`` completion; (status, events): each ``data:`` payload parsed, ``[DONE]`` as is
    (``first`` is set at the first event)."""
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps({**payload, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    events: list[Any] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if first is not None:
                    first.set()
    except urllib.error.HTTPError as exc:
        return exc.code, [exc.read().decode(errors="replace")]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return -1, [*events, f"{type(exc).__name__}: {exc}"]
    return status, events


def complete_all(url: str, payloads: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any] | str]]:
    """Every payload at once, one client thread each."""
    return run_requests(url, payloads, len(payloads)).answers
