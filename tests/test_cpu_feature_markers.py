"""tests/conftest.py deselects a test of a CPU feature the host lacks, with one line, and fails it when asked for.

Each case runs pytest in a child on a small test file whose conftest is the suite's own; the host's flags come
from ``$AFD_MRV2_TEST_CPU_FLAGS`` (``-amx_tile``: as this host, less AMX; ``+amx_tile``: with it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = """
import pytest

@pytest.mark.amx
def test_needs_amx():
    pass

@pytest.mark.amx
@pytest.mark.parametrize("case", ["a", "b"])
def test_needs_amx_too(case):
    pass

def test_needs_nothing():
    pass
"""


def _pytest(tmp_path: Path, flags: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import _require_hardware, pytest_collection_modifyitems, pytest_report_collectionfinish\n"
    )
    (tmp_path / "test_features.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    amx: needs AMX tiles\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AFD_MRV2_TEST_CPU_FLAGS": flags}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_the_feature_its_tests_are_deselected_with_one_line(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "-amx_tile")
    assert run.returncode == 0, run.stdout
    lines = [line for line in run.stdout.splitlines() if "not run" in line]
    assert lines == ["no amx_tile on this host ($AFD_MRV2_TEST_CPU_FLAGS): 3 tests marked amx not run"], run.stdout
    assert "1 passed, 3 deselected" in run.stdout


def test_with_the_feature_reported_they_run(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "+amx_tile")
    assert run.returncode == 0 and "4 passed" in run.stdout and "not run" not in run.stdout, run.stdout


def test_a_plain_list_replaces_the_host_s_flags(tmp_path: Path) -> None:
    assert "3 deselected" in _pytest(tmp_path, "avx2 avx512f").stdout
    assert "4 passed" in _pytest(tmp_path, "avx512f,amx_tile").stdout


@pytest.mark.parametrize(
    "args",
    [("-m", "amx"), ("test_features.py::test_needs_amx",), ("test_features.py::test_needs_amx_too[a]",)],
    ids=["by-marker", "by-node-id", "by-parametrized-node-id"],
)
def test_requested_explicitly_without_the_feature_it_fails_loudly(tmp_path: Path, args: tuple[str, ...]) -> None:
    run = _pytest(tmp_path, "-amx_tile", *args)
    assert run.returncode == 1, run.stdout
    assert "test marked 'amx' was selected but its prerequisite is missing: no amx_tile on this host" in run.stdout
    assert "passed" not in run.stdout.splitlines()[-1]
