"""Against the real vLLM, where it is importable (``pytest -m vllm_runtime``; deselected by default).

Selected on a machine without vLLM these FAIL (tests/conftest.py), never skip.  The
composition over the CUDA ubatch runner lives in tests/mrv2/test_composition_cuda.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from afd_mrv2.compat.contracts import DirectorySource, check_contracts

pytestmark = pytest.mark.vllm_runtime


def test_contracts_pass_against_the_installed_vllm() -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    report = check_contracts(DirectorySource(Path(next(iter(spec.submodule_search_locations))).parent))
    assert report.violations == [], [str(v) for v in report.violations]
