"""What serve copies from a role's output: vLLM's abort-shutdown traceback is folded into one line only
when serve stopped the role and only when it is that traceback; anything else is shown as it is."""

from __future__ import annotations

import asyncio
import io

from afd_mrv2.serve.plan import RoleSpec
from afd_mrv2.serve.roles import RoleProcess, cause_of_exit

TAG = "(APIServer pid=7) ERROR 12-02 07:56:17 [async_llm.py:906]"
ABORT = [
    f"{TAG} AsyncLLM output_handler failed.",
    f"{TAG} Traceback (most recent call last):",
    f'{TAG}   File "vllm/v1/engine/async_llm.py", line 849, in output_handler',
    f"{TAG} vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
]
OTHER = [
    f"{TAG} AsyncLLM output_handler failed.",
    f"{TAG} Traceback (most recent call last):",
    f"{TAG} ValueError: something else went wrong",
]
AFTER = "INFO:     Shutting down"


def copied(lines: list[str], *, stopping: bool) -> list[str]:
    log = io.StringIO()
    role = RoleProcess(RoleSpec("attention", 0, ("x",), {}), log, lambda r: None)
    role.stopping = stopping
    for line in lines:
        if not role._folding(line):
            role._say(line)
    asyncio.run(role.close())
    return log.getvalue().splitlines()


def test_the_abort_traceback_is_one_line_once_serve_stopped_the_role() -> None:
    out = copied([*ABORT, AFTER], stopping=True)
    assert out[0] == f"[attention 0] {AFTER}"
    assert len(out) == 2 and "4 lines of vLLM's abort shutdown not shown" in out[1]
    assert not any("Traceback" in line for line in out)


def test_the_abort_traceback_at_the_end_of_the_output_is_folded_too() -> None:
    out = copied(ABORT, stopping=True)
    assert len(out) == 1 and "EngineDeadError" in out[0] and "not shown" in out[0]


def test_another_traceback_is_shown_in_full_even_while_stopping() -> None:
    out = copied([*OTHER, AFTER], stopping=True)
    assert out == [f"[attention 0] {line}" for line in [*OTHER, AFTER]]


def test_the_same_traceback_before_any_stop_is_shown_in_full() -> None:
    out = copied([*ABORT, AFTER], stopping=False)
    assert out == [f"[attention 0] {line}" for line in [*ABORT, AFTER]]


def test_a_group_member_that_ended_long_before_the_leader_is_not_named_as_the_cause() -> None:
    """vLLM's EngineCore that ended a second before the engine died is why it died; one that ended minutes
    before is not; and vLLM's short-lived compiler runs (g++) in an engine's group never are, however
    recent (one that ended 5 s before a SIGKILL of the engine was named as its cause)."""
    gone = [(100.0, 42, "VLLM::EngineCor"), (398.5, 43, "python3")]
    assert cause_of_exit(gone, 400.0) == (43, "python3")
    assert cause_of_exit(gone[:1], 400.0) is None
    assert cause_of_exit([(395.0, 41, "g++"), (398.5, 42, "VLLM::EngineCor")], 400.0) == (42, "VLLM::EngineCor")
    assert cause_of_exit([(395.0, 41, "g++"), (396.0, 44, "cc1plus")], 400.0) is None
