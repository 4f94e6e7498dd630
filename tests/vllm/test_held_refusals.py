"""A held set cannot express EPLB, expert parallelism across ranks or fused shared experts: each role's MoE
layer refuses them in one line when it is built (issue 26).

Run: ``.venv-vllm/bin/python -m pytest -q -m vllm_runtime tests/vllm/test_held_refusals.py``.

Upstream's own ``FusedMoEParallelConfig`` (``make_no_parallel``, fields replaced) and ``ExpertMapManager``
(built as vLLM's factory builds it; its fused-shared count stood in on CPU) feed the refusal the layer runs first in its ``__init__``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.vllm_runtime]


def _manager(parallel: object, fused_shared: int) -> object:
    """vLLM's manager as its factory builds it; with fused shared experts (whose placement needs a GPU to
    build) the one attribute the refusal reads."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    if fused_shared:
        return SimpleNamespace(num_fused_shared_experts=fused_shared)
    return ExpertMapManager(
        max_num_batched_tokens=256,
        top_k=2,
        global_num_experts=8,
        num_redundant_experts=0,
        num_expert_group=None,
        moe_parallel_config=parallel,
        placement_strategy="linear",
        enable_eplb=False,
    )


@pytest.mark.parametrize(
    ("changes", "fused_shared", "said"),
    [
        ({"enable_eplb": True}, 0, "asks for EPLB (enable_eplb)"),
        ({"use_ep": True, "ep_size": 2}, 0, "asks for expert parallelism across 2 ranks"),
        ({}, 1, "asks for 1 fused shared experts"),
    ],
    ids=["eplb", "ep2", "fused-shared"],
)
@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_each_role_refuses_what_a_held_set_cannot_express(
    role: str, changes: dict[str, object], fused_shared: int, said: str
) -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    from afd_mrv2.errors import ConfigError
    from afd_mrv2.mrv2.attention.experts import _refuse_held_set

    plain = FusedMoEParallelConfig.make_no_parallel()
    parallel = dataclasses.replace(plain, **changes)  # type: ignore[arg-type]
    manager = _manager(plain, fused_shared)
    moe_config = SimpleNamespace(moe_parallel_config=parallel)
    with pytest.raises(ConfigError) as raised:
        _refuse_held_set("model.layers.1.mlp.experts", role, moe_config, manager)  # type: ignore[arg-type]
    message = str(raised.value)
    assert said in message and "model.layers.1.mlp.experts" in message and f"the {role} role" in message
    assert "\n" not in message
    _refuse_held_set("model.layers.1.mlp.experts", role, SimpleNamespace(moe_parallel_config=plain), _manager(plain, 0))  # type: ignore[arg-type]
