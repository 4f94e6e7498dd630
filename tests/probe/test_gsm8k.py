"""The GSM8K-style accuracy check: answer extraction, problem files, prompts and scoring."""

from __future__ import annotations

import json

import pytest

from afd_mrv2.errors import AfdError
from afd_mrv2.probe import gsm8k


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("6 * 12 = 72, then 72 - 50 = 22.\n#### 22", "22"),
        ("#### 1,234", "1234"),
        ("so the answer is #### $18.00 dollars", "18"),
        ("#### -5", "-5"),
        ("#### 2.50", "2.50"),
        ("He has 3 apples, then 4 more, so 7.", "7"),  # no marker: the last number
        ("first 10 then #### x but 12 later", "12"),  # a marker with no number after it: the last number
        ("The answer is 1,000,000.", "1000000"),
        ("#### 4 #### 9", "9"),  # the last marker counts
        ("#### 42\nThe next question has 7 apples.", "42"),  # the marker wins over a later number
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert gsm8k.extract_answer(text) == answer


def test_builtin_problems_have_their_answers_and_distinct_questions() -> None:
    answers = [p.answer for p in gsm8k.BUILTIN]
    assert answers == ["22", "80", "137", "3", "54", "8", "32", "255"]
    assert len({p.question for p in gsm8k.BUILTIN}) == len(gsm8k.BUILTIN)


def test_load_jsonl_in_gsm8k_format(tmp_path) -> None:
    path = tmp_path / "test.jsonl"
    rows = [{"question": "1 + 1?", "answer": "One plus one is 2.\n#### 2"}, {"question": "3 * 3?", "answer": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = gsm8k.load_jsonl(path)
    assert [(p.question, p.answer) for p in problems] == [("1 + 1?", "2"), ("3 * 3?", "9")]


@pytest.mark.parametrize(
    ("content", "text"),
    [
        ('{"question": "q"}\n', "test.jsonl:1: expected an object with question and answer"),
        ("not json\n", "test.jsonl:1: expected"),
        ('{"question": "q", "answer": "no number"}\n', "without a numeric answer"),
        ("\n", "holds no problems"),
    ],
)
def test_bad_problem_files(tmp_path, content: str, text: str) -> None:
    path = tmp_path / "test.jsonl"
    path.write_text(content)
    with pytest.raises(AfdError, match=text):
        gsm8k.load_jsonl(path)
    with pytest.raises(AfdError, match="cannot read"):
        gsm8k.load_jsonl(tmp_path / "absent.jsonl")


def test_prompt_is_few_shot_and_leaves_the_question_out_of_its_own_shots() -> None:
    target = gsm8k.BUILTIN[1]
    text = gsm8k.prompt(target, gsm8k.BUILTIN[:3])
    assert text.count("Question:") == 3  # two shots (the target is not its own shot) and the question
    assert text.endswith(f"Question: {target.question}\nAnswer:")
    assert gsm8k.BUILTIN[0].solution in text
    body = gsm8k.request("m", target, gsm8k.BUILTIN[:3], 64)
    assert (body["model"], body["max_tokens"], body["temperature"], body["prompt"]) == ("m", 64, 0.0, text)
    assert "Question:" in body["stop"]


def test_score_counts_failed_requests_and_wrong_answers() -> None:
    problems = gsm8k.BUILTIN[:4]
    result = gsm8k.score(problems, [" ... #### 22", "80 pages.", None, "#### 4"])
    assert (result.correct, result.total, result.accuracy) == (2, 4, 0.5)
    assert result.rows[2] == ("137", None, False) and result.rows[3] == ("3", "4", False)
    with pytest.raises(ValueError, match="4 problems but 1 completions"):
        gsm8k.score(problems, ["1"])
