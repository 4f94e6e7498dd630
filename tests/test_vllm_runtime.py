"""Against the real vLLM, where it is importable (``pytest -m vllm_runtime``; deselected by default).

Selected on a machine without vLLM these FAIL (tests/conftest.py), never skip.
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


def test_attention_runner_composes_over_the_real_platform_runner() -> None:
    from afd_mrv2.compat import check_runtime
    from afd_mrv2.mrv2.runner import AfdAttentionRunnerMixin, attention_runner_class
    from afd_mrv2.mrv2.ubatch_runner import afd_ubatch_runner_class
    from afd_mrv2.mrv2.upstream import load_upstream

    decision = check_runtime(("mrv2", "ubatch_runner"))
    assert decision.accepted, decision.message()
    upstream = load_upstream(decision.platform)
    runner_cls = attention_runner_class(upstream)
    assert issubclass(runner_cls, upstream.platform_runner) and issubclass(runner_cls, AfdAttentionRunnerMixin)
    ubatch_cls = afd_ubatch_runner_class(upstream.ubatch_runner)
    assert issubclass(ubatch_cls, upstream.ubatch_runner)
    assert isinstance(vars(ubatch_cls.__mro__[1])["comm_stream"], property)
