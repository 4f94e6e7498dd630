"""serve's support-matrix check (afd_mrv2.serve.app.check_deployments) without vLLM: what it hands the
child and how it reads the answer.  The child itself, on real VllmConfigs, is tests/vllm/test_support_matrix.py."""

from __future__ import annotations

import json
import sys

import pytest

from afd_mrv2.errors import AfdError
from afd_mrv2.serve import app
from afd_mrv2.serve.plan import ServeOptions, build_plan
from tests.serve.conftest import free_port_block

#: A stand-in child: records its arguments, then answers what ANSWER (an environment variable) says
CHILD = """
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--out") + 1]
answer = json.loads(os.environ["ANSWER"])
if answer is not None:
    json.dump({**answer, "args": args}, open(out, "w"))
sys.exit(int(os.environ.get("CODE", "0")))
"""


def plan(*extra: str):
    opts = ServeOptions(
        "/models/m",
        2,
        1,
        port=free_port_block(4),
        depth="2",
        extra=("--additional-config", '{"afd": {"host": "127.0.0.1"}, "other": 1}', *extra),
    )
    return build_plan(opts)


@pytest.fixture
def child(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(app, "DEPLOYMENT_CHECK", (sys.executable, "-c", CHILD))

    def answer(value: object, code: int = 0) -> None:
        monkeypatch.setenv("ANSWER", json.dumps(value))
        monkeypatch.setenv("CODE", str(code))

    return answer


def test_a_refusal_is_serves_one_line(child) -> None:
    child(
        {"refused": "afd.multistream.enabled: multistream runs eager only (the attention role's engine arguments)"}, 2
    )
    with pytest.raises(AfdError) as info:
        app.check_deployments(plan("--dtype", "float32"))
    assert str(info.value) == (
        "afd.multistream.enabled: multistream runs eager only (the attention role's engine arguments)"
    )


def test_the_child_gets_one_section_per_role_and_the_engine_arguments(child, monkeypatch) -> None:
    seen: list[list[str]] = []
    real_popen = app.subprocess.Popen

    def popen(cmd, **kwargs):
        seen.append(list(cmd))
        return real_popen(cmd, **kwargs)

    monkeypatch.setattr(app.subprocess, "Popen", popen)
    child({"deployments": {}})
    app.check_deployments(plan("--dtype", "float32", "--enforce-eager"))
    (cmd,) = seen
    args = cmd[3:]
    assert args[:3] == ["/models/m", "--out", args[2]]
    sections = [json.loads(args[i + 1]) for i, a in enumerate(args) if a == "--section"]
    assert [(s["role"], s["rank"]) for s in sections] == [("attention", 0), ("ffn", 0)]
    assert all(s["multistream"]["enabled"] and s["host"] == "127.0.0.1" for s in sections)
    # serve rewrites --additional-config per role: the child gets the sections, not the original flag
    assert args[args.index("--") + 1 :] == ["--dtype", "float32", "--enforce-eager"]


@pytest.mark.parametrize(
    ("answer", "code", "text"),
    [
        ({"failed": "vLLM cannot build the ffn role's config: ValueError: bad"}, 3, "vLLM cannot build the ffn role's"),
        (None, 1, "the support-matrix check of the roles' vLLM configs failed (exit 1)"),
    ],
    ids=["vllm-refused-the-arguments", "child-died"],
)
def test_no_answer_refuses_rather_than_starting(child, answer, code: int, text: str) -> None:
    child(answer, code)
    with pytest.raises(AfdError, match=text.replace("(", r"\(").replace(")", r"\)")):
        app.check_deployments(plan())


def test_under_ubatches_the_attention_check_sees_the_v2_runner_and_eager(child, monkeypatch) -> None:
    """``--ubatches``: the child checks the Attention section with the V2 runner's environment and the
    ``--enforce-eager`` serve adds for that role only, in a form the child's own parser takes."""
    seen: list[tuple[list[str], dict[str, str]]] = []
    real_popen = app.subprocess.Popen

    def popen(cmd, **kwargs):
        seen.append((list(cmd), dict(kwargs["env"])))
        return real_popen(cmd, **kwargs)

    monkeypatch.setattr(app.subprocess, "Popen", popen)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    child({"deployments": {}})
    opts = ServeOptions("/models/m", 1, 1, port=free_port_block(3), ubatches=2, extra=("--dtype", "float32"))
    app.check_deployments(build_plan(opts))
    ((cmd, env),) = seen
    args = cmd[3:]
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "--attention-arg=--enforce-eager" in args[: args.index("--")]
    assert args[args.index("--") + 1 :] == ["--dtype", "float32"]
    sections = [json.loads(args[i + 1]) for i, a in enumerate(args) if a == "--section"]
    assert all(s["ubatch"] == {"num_ubatches": 2} for s in sections)
    # and the real child parses that form (the value begins with "--")
    from afd_mrv2.serve import preflight

    parsed = preflight.argparse.ArgumentParser(allow_abbrev=False)
    parsed.add_argument("--attention-arg", action="append", default=[])
    assert parsed.parse_args(["--attention-arg=--enforce-eager"]).attention_arg == ["--enforce-eager"]
