"""``afd-mrv2 serve`` on the accepted vLLM-Ascend pair (faked distribution metadata and CANN install-info):
micro-batching is refused before any role starts, in one line that says what vLLM-Ascend lacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fakedist import make_cann_info, make_site
from tests.serve.conftest import free_port_block

PAIR = {"vllm": "0.30.0", "vllm-ascend": "0.30.0rc2", "torch": "2.10.0", "torch-npu": "2.10.0.post4"}


def test_ubatches_on_the_ascend_pair_is_refused_naming_what_upstream_lacks(tmp_path: Path) -> None:
    site = make_site(tmp_path / "site", PAIR)
    toolkit = tmp_path / "toolkit"
    arch = f"{os.uname().machine}-linux"
    (toolkit / arch).mkdir(parents=True)
    make_cann_info(toolkit / arch, "9.2.0")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_local_experts": 8}')
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["ASCEND_TOOLKIT_HOME"] = str(toolkit)
    cmd = [sys.executable, "-m", "afd_mrv2.cli", "serve", str(model), "--attention", "1", "--ffn", "1"]
    cmd += ["--port", str(free_port_block(3)), "--ubatches", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("afd-mrv2 serve: error: "), lines
    assert "ascend-0.30.0rc2" in lines[0] and "ubatch_runner" in lines[0], lines[0]
    assert "vLLM-Ascend 0.30.0rc2 has no micro-batching" in lines[0], lines[0]
