"""scripts/e2e_matrix.py and ``afd-mrv2 probe npu`` write the same evidence document (afd-mrv2/evidence/v1).

The E2E script runs for real: against a fake OpenAI endpoint (accuracy rows), launching that
endpoint per cell (``--launch``: rows per cell, cleanup), and its async-MoE axis on the embedded
run.  Its CPU topology axis needs vLLM (``tests/vllm`` territory); docs/ascend-deployment.md
holds a measured run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from afd_mrv2.cli import main as cli_main
from afd_mrv2.hooks.cam.evidence import Report, validate
from afd_mrv2.ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "e2e_matrix.py"
FAKE = Path(__file__).with_name("fake_openai.py")


def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def fake_server(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, str(FAKE), str(port)], env={"PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("fake server did not start")


def load_script():
    """The script as a module (its sibling package serving importable while it loads)."""
    if "e2e_matrix" in sys.modules:
        return sys.modules["e2e_matrix"]
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("e2e_matrix", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["e2e_matrix"] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_endpoint_accuracy_rows_validate(tmp_path) -> None:
    port = free_port_block(1)
    server = fake_server(port)
    try:
        out = tmp_path / "e2e.json"
        done = script("--endpoint", f"http://127.0.0.1:{port}", "--cell", "2a1f-token", "--evidence", str(out))
        failing = script(
            "--endpoint", f"http://127.0.0.1:{port}", "--min-accuracy", "0.9", "--limit", "5",
            "--prefills", "single", "--evidence", str(tmp_path / "strict.json"),
        )  # fmt: skip
    finally:
        server.kill()
        server.wait()
    assert done.returncode == 0, done.stderr
    raw = json.loads(out.read_text())
    assert validate(raw) == [] and raw["producer"] == "scripts/e2e_matrix.py"
    assert raw["environment"]["mode"] == "endpoint" and "torch" in raw["versions"]
    rows = {c["name"]: c for c in raw["checks"]}
    assert set(rows) == {"e2e:gsm8k:2a1f-token:batched", "e2e:gsm8k:2a1f-token:single"}
    batched = rows["e2e:gsm8k:2a1f-token:batched"]
    assert batched["status"] == "pass" and batched["measured"]["accuracy"] == 7 / 8
    assert batched["measured"]["clients"] == 8 and rows["e2e:gsm8k:2a1f-token:single"]["measured"]["clients"] == 1
    assert batched["measured"]["answers"][4] == "0" and batched["measured"]["expected"][4] == "54"
    assert "accuracy 7/8 = 0.88" in done.stdout
    # 4/5 = 0.8 is below 0.9: a failed row and exit 1
    assert failing.returncode == 1
    strict = Report.load(tmp_path / "strict.json")
    assert [(c.name, c.status) for c in strict.checks] == [("e2e:gsm8k:endpoint:single", "fail")]


def test_launch_runs_each_cell_and_checks_cleanup(tmp_path) -> None:
    port = free_port_block(1)
    out = tmp_path / "e2e.json"
    launch = f"{sys.executable} {FAKE} {port}"
    done = script(
        "--launch", launch, "--endpoint", f"http://127.0.0.1:{port}", "--topologies", "2a1f", "3a2f",
        "--splits", "token", "--prefills", "single", "--limit", "2", "--work", str(tmp_path / "work"),
        "--evidence", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = Report.load(out)
    assert [(c.name, c.status) for c in report.checks] == [
        ("e2e:gsm8k:2a1f-token:single", "pass"),
        ("e2e:cleanup:2a1f-token", "pass"),
        ("e2e:gsm8k:3a2f-token:single", "pass"),
        ("e2e:cleanup:3a2f-token", "pass"),
    ]
    assert report.environment["mode"] == "launch"


def test_cell_environment_for_the_launch_command() -> None:
    matrix = load_script()
    cell = matrix.Cell(3, 2, "token")
    assert (cell.name, matrix.topology("3A2F")) == ("3a2f-token", (3, 2))
    assert cell.afd("camasync") == {
        "connector": "camasync",
        "num_attention_ranks": 3,
        "num_ffn_ranks": 2,
        "compute_gate_on_attention": True,
        "async": True,
        "async_moe": {"enabled": True, "split": "token"},
    }
    assert "async_moe" not in matrix.Cell(1, 1, "off").afd("torch_p2p")
    assert matrix.config_of(2, 1) is matrix.matrix.CONFIGS["2a1f"]
    free = matrix.config_of(3, 2)  # not in serving.matrix.CONFIGS: serve decides whether it serves it
    assert (free.topology.attention, free.topology.ffn, free.criteria) == (3, 2, matrix.matrix.TWO_ATTENTION)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--launch", "true"], "--launch needs --endpoint"),
        (["--topologies", "2x1"], "expected values such as 1a1f"),
        (["--topologies", "0a2f"], "expected at least one Attention and one FFN rank"),
        (["--arch", "llama"], "--arch: expected one of"),
        (["--splits", "half"], "--splits: expected some of off, token, request"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], text: str, capsys: pytest.CaptureFixture[str], signals_restored: None
) -> None:
    assert load_script().main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and text in err and err.count("\n") == 1


def test_bad_input_as_a_program_is_one_line_and_exit_2() -> None:
    """The cases above go through ``main`` in this process; the script itself exits the same way."""
    done = script("--splits", "half")
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert "--splits: expected some of off, token, request" in done.stderr


def test_async_moe_axis_on_the_embedded_run(tmp_path) -> None:
    """The CPU async-MoE axis: a real embedded run per split (one with the SP layout), its plans proving the
    policy activated.  Two cells of the four: the layouts x splits themselves are tests/reference's."""
    matrix = load_script()
    rows = []
    for split, layout in (("token", "sp"), ("request", "none")):
        args, _ = matrix.parse_args(
            ["--splits", split, "--prefills", "single", "--layouts", layout, "--work", str(tmp_path / split)]
        )
        rows += matrix.embedded_rows(args)
    assert [(r.name, r.status) for r in rows] == [
        ("e2e:async-moe:token:single:sp", "pass"),
        ("e2e:async-moe:request:single", "pass"),
    ]
    assert rows[0].measured["attention_tp"] == 2 and rows[0].measured["layout"] == "sp"
    token, request = rows
    assert token.measured["continued_requests"] >= 1 and all(len(s) == 2 for s in token.measured["stage_tokens"])
    assert all(len(s) == 1 for s in request.measured["stage_tokens"])  # one request: unsplit
    assert token.measured["max_abs_diff"] <= token.measured["tolerance"]
    doc = Report("scripts/e2e_matrix.py", tuple(rows)).to_json()
    assert validate(doc) == []


def test_activation_needs_the_plans_to_show_the_policy() -> None:
    matrix = load_script()
    two = {"stage_tokens": [10, 10], "continued": []}
    cut = {"stage_tokens": [48, 48], "continued": [{"request": 0}]}
    assert matrix.activation("token", "batched", [two])[0]
    assert not matrix.activation("token", "single", [two])[0]  # no request was cut
    assert matrix.activation("token", "single", [cut])[0]
    assert matrix.activation("request", "single", [{"stage_tokens": [96], "continued": []}])[0]
    assert not matrix.activation("request", "batched", [{"stage_tokens": [96]}])[0]
    assert matrix.activation("request", "batched", []) == (False, "the run reported no split plans")


def test_both_producers_write_one_schema(tmp_path) -> None:
    """probe npu (here: every row skipped, no NPU) and the E2E script validate against the same schema."""
    probe_out = tmp_path / "probe.json"
    assert cli_main(["probe", "npu", "--out", str(probe_out)]) == 3
    probe = json.loads(probe_out.read_text())
    matrix = load_script()
    rows = [matrix.Check("e2e:async-moe:vllm", "skipped", None, f"skipped: {matrix.NO_STAGES_IN_CPU_VLLM}")]
    e2e = matrix.evidence(rows, "cpu", time.monotonic(), (0.0, 0.0, 0.0)).to_json()
    for doc in (probe, e2e):
        assert validate(doc) == []
    assert probe["schema"] == e2e["schema"] and set(probe) == set(e2e)
    assert set(probe["environment"]) <= set(e2e["environment"])
