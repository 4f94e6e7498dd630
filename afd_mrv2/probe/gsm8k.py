"""A small GSM8K-style accuracy check: prompts, answer extraction, scoring (no network, no lm-eval).

The E2E matrix (``scripts/e2e_matrix.py``) asks a served model grade-school word
problems and scores the final numbers.  Problems come from a JSONL file in
GSM8K's own format (one ``{"question": ..., "answer": "... #### 72"}`` per line;
``answer`` may also be a bare number) or from :data:`BUILTIN`, a handful written
for this project, which also serve as the few-shot examples.

Answer extraction (:func:`extract_answer`): the number after the last ``####``
if the text has one, else the last number in the text; commas, a leading ``$``
and a trailing ``.`` are dropped and ``12.0`` counts as ``12``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_mrv2.errors import AfdError

MARKER = "####"
#: where a completion's answer ends: the next few-shot question, or a blank line
STOP = ("Question:", "\n\n\n")
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Problem:
    question: str
    #: the worked solution ending ``#### N`` (used in few-shot prompts), or just ``N``
    solution: str

    @property
    def answer(self) -> str:
        found = extract_answer(self.solution)
        if found is None:
            raise AfdError(f"gsm8k: problem without a numeric answer: {self.question[:60]!r}")
        return found


BUILTIN = (
    Problem(
        "A baker fills 6 trays with 12 rolls each and sells 50 rolls. How many rolls are left?",
        "The trays hold 6 * 12 = 72 rolls. After selling 50, 72 - 50 = 22 rolls are left.\n#### 22",
    ),
    Problem(
        "Mia reads 15 pages a day for 4 days and then 20 pages on the fifth day. How many pages did she read?",
        "In four days she reads 15 * 4 = 60 pages. With the fifth day, 60 + 20 = 80 pages.\n#### 80",
    ),
    Problem(
        "A bus has 40 seats. 3 buses are full and a fourth bus has 17 people. How many people ride the buses?",
        "The full buses carry 3 * 40 = 120 people. Adding the fourth bus, 120 + 17 = 137 people.\n#### 137",
    ),
    Problem(
        "Tom buys 5 notebooks at $3 each and a pen for $2. He pays with a $20 bill. How much change does he get?",
        "The notebooks cost 5 * 3 = 15 dollars, and with the pen 15 + 2 = 17 dollars. "
        "His change is 20 - 17 = 3 dollars.\n#### 3",
    ),
    Problem(
        "A garden has 8 rows of 9 tulips. A quarter of the tulips are red. How many tulips are not red?",
        "There are 8 * 9 = 72 tulips. A quarter, 72 / 4 = 18, are red, so 72 - 18 = 54 are not.\n#### 54",
    ),
    Problem(
        "A tank holds 250 liters. It is filled at 25 liters per minute starting from 50 liters. "
        "How many minutes until it is full?",
        "It needs 250 - 50 = 200 more liters. At 25 liters per minute that takes 200 / 25 = 8 minutes.\n#### 8",
    ),
    Problem(
        "Sam has 3 times as many marbles as Lee. Lee has 14 marbles. Sam gives away 10. How many does Sam have now?",
        "Sam starts with 3 * 14 = 42 marbles. After giving away 10 he has 42 - 10 = 32.\n#### 32",
    ),
    Problem(
        "A train travels 60 km per hour for 2 hours and 45 km per hour for 3 more hours. How far does it travel?",
        "First 60 * 2 = 120 km, then 45 * 3 = 135 km, in all 120 + 135 = 255 km.\n#### 255",
    ),
)


def _normalise(number: str) -> str:
    text = number.replace(",", "").replace("$", "").rstrip(".")
    if "." in text:
        whole, _, frac = text.partition(".")
        if not frac.strip("0"):
            text = whole
    if text in ("-0", ""):
        text = "0"
    return text


def extract_answer(text: str) -> str | None:
    """The final number of ``text``: after the last ``####`` if present, else the last number."""
    if MARKER in text:
        tail = text.rsplit(MARKER, 1)[1]
        found = _NUMBER.search(tail)
        if found is not None:
            return _normalise(found.group())
    numbers = _NUMBER.findall(text)
    return _normalise(numbers[-1]) if numbers else None


def load_jsonl(path: str | Path) -> list[Problem]:
    """GSM8K-format problems, one JSON object per line (blank lines skipped)."""
    problems = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise AfdError(f"gsm8k: cannot read {str(path)!r}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = Problem(str(row["question"]), str(row["answer"]))
        except (ValueError, KeyError, TypeError):
            raise AfdError(f"gsm8k: {path}:{number}: expected an object with question and answer") from None
        problem.answer  # noqa: B018 - refuse a problem without a numeric answer now, not when scoring
        problems.append(problem)
    if not problems:
        raise AfdError(f"gsm8k: {path} holds no problems")
    return problems


def prompt(problem: Problem, shots: Sequence[Problem] = ()) -> str:
    """Few-shot prompt: each shot as ``Question: ...\\nAnswer: <solution>``, then the question."""
    parts = [f"Question: {s.question}\nAnswer: {s.solution}\n\n" for s in shots if s.question != problem.question]
    return "".join(parts) + f"Question: {problem.question}\nAnswer:"


def request(model: str, problem: Problem, shots: Sequence[Problem] = (), max_tokens: int = 256) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request body for ``problem``."""
    return {
        "model": model,
        "prompt": prompt(problem, shots),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stop": list(STOP),
    }


@dataclass(frozen=True)
class Score:
    correct: int
    total: int
    #: per problem: expected answer, extracted answer (None: no number), correct
    rows: tuple[tuple[str, str | None, bool], ...]

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def score(problems: Sequence[Problem], completions: Sequence[str | None]) -> Score:
    """Score ``completions[i]`` (None: the request failed) against ``problems[i]``."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    rows = []
    for problem, text in zip(problems, completions, strict=True):
        got = None if text is None else extract_answer(text)
        rows.append((problem.answer, got, got == problem.answer))
    return Score(sum(ok for *_, ok in rows), len(rows), tuple(rows))
