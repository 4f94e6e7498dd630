"""``afd-mrv2 compat check`` as a user's CI step: exit codes and JSON, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fakedist import make_site

_MAIN = "import sys; from afd_mrv2.cli import main; sys.exit(main())"


def _run(args: list[str], site: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AFD_MRV2_", "ASCEND_"))}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", _MAIN, *args], capture_output=True, text=True, env=env, timeout=60)


def test_check_on_this_machine_refuses_helpfully() -> None:
    """This machine has no vLLM: exit 1, and the JSON says what is installed and what would be accepted."""
    out = _run(["compat", "check", "--json"])
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["accepted"] is False and report["installed"]["vllm"] is None
    assert report["installed"]["torch"] is not None  # the project's own torch is reported
    assert report["reasons"] == ["vLLM is not installed (no 'vllm' distribution metadata found)"]
    assert report["accepted_pairs"] == ["cuda-vllm-0.33.0", "cuda-vllm-0.30.0"]
    assert "install one of the accepted pairs" in report["message"]


def test_check_accepts_a_faked_pinned_pair_and_honours_require(tmp_path: Path) -> None:
    site = make_site(tmp_path, {"vllm": "0.33.0", "torch": "2.14.0"})
    ok = _run(["compat", "check", "--require", "ubatch_runner", "worker_runner_factory"], site)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ACCEPTED as cuda-vllm-0.33.0" in ok.stdout
    refused = _run(["compat", "check", "--json", "--require", "camp2p"], site)
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["reasons"][0].startswith("required capability camp2p not granted")
    bad = _run(["compat", "check", "--require", "nonsense"], site)
    assert bad.returncode == 2 and "unknown capability nonsense" in bad.stderr


def test_table_lists_every_row() -> None:
    out = _run(["compat", "table", "--json"])
    rows = json.loads(out.stdout)
    assert out.returncode == 0 and len(rows) >= 10
    assert {r["status"] for r in rows} == {"accepted-unvalidated", "refused"}
