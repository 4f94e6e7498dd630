"""The completions client the vLLM tests and scripts share: comparisons and errors as values."""

from __future__ import annotations

import math

from scripts.serving import body, compare, complete, greedy
from tests.serve.conftest import free_port_block


def test_compare_counts_identical_completions_differing_tokens_and_the_logprob_gap() -> None:
    a = [([1, 2, 3], [-0.5, -1.0, -2.0]), ([4, 5], [-0.1, -0.2]), ([7, 8, 9], [-1.0, -1.0, -1.0])]
    b = [([1, 2, 3], [-0.5, -1.25, -2.0]), ([4, 6], [-0.1, -0.3]), ([7, 8], [-1.0, -1.0])]
    got = compare(a, b)
    assert got == {"completions": 3, "identical": 1, "tokens": 8, "differing": 2, "max_logprob_diff": 0.25}
    assert math.isnan(compare([([1], [0.0])], [([2], [0.0])])["max_logprob_diff"])  # nothing identical


def test_greedy_reads_token_ids_and_logprobs_and_body_is_greedy() -> None:
    answer = {"choices": [{"token_ids": [3, 4], "logprobs": {"token_logprobs": [-1, -0.5]}}]}
    assert greedy(answer) == ([3, 4], [-1.0, -0.5])
    request = body("/m", "hi", 4, logprobs=1)
    assert request == {
        "model": "/m",
        "prompt": "hi",
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
    }


def test_complete_on_a_closed_port_is_an_error_value_not_an_exception() -> None:
    status, text = complete(f"http://127.0.0.1:{free_port_block(1)}", body("/m", "x", 1), timeout=5)
    assert status == -1 and "Connection refused" in str(text)


def test_line_reader_waits_for_a_prefix_and_gives_up_when_the_writer_is_gone() -> None:
    import subprocess
    import sys
    import time

    from scripts.serving import LineReader

    code = "import time; print('starting', flush=True); time.sleep(0.3); print('ready at x', flush=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    reader = LineReader(proc.stdout)  # type: ignore[arg-type]

    def alive() -> bool:
        return proc.poll() is None

    assert reader.wait_for("ready at", deadline=time.monotonic() + 30, alive=alive)
    proc.wait()
    assert reader.lines[:2] == ["starting", "ready at x"]
    assert not reader.wait_for("never", deadline=time.monotonic() + 30, alive=alive)  # exited: no wait
    assert not reader.wait_for("never", deadline=time.monotonic() - 1, alive=lambda: True)  # past the deadline
