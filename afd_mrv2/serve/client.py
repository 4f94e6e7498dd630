"""A small OpenAI-completions client for checking an endpoint against another (stdlib only).

What the equivalence checks need, in one place for the tests (tests/vllm) and the
scripts (scripts/vllm_matrix.py, scripts/bench_serve.py):

* :func:`body`: a greedy request that generates exactly ``max_tokens`` (``ignore_eos``);
* :func:`complete`: ``POST /v1/completions``; an error is a status, never an exception
  or a hang (status -1 when the connection failed or was cut);
* :func:`greedy`: the token ids and logprobs of an answer asked with ``logprobs: 1,
  return_token_ids: true``;
* :func:`compare`: two lists of such answers, side by side;
* :data:`PROMPTS` / :func:`prompts`: the fixed prompts the equivalence checks send;
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
from pathlib import Path
from typing import IO, Any

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
