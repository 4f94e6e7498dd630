"""Every upstream-seam contract, statically, against the real vllm 0.30.0 wheel with the vllm-ascend 0.30.0rc2
sdist (the pair the table row ``ascend-0.30.0rc2`` accepts), and negative controls on edited copies.

Both are read, never installed nor imported: the wheel from .wheels/ (downloaded by the unit run
earlier in CI: tests/compat/conftest.py), the sdist unpacked by scripts/setup_ascend_vehicle.sh
(the ``ascend_src`` fixture).  No subprocess: the whole file takes about a second.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from afd_mrv2.cli import main
from afd_mrv2.compat.contracts import (
    ContractReport,
    DirectorySource,
    StackSource,
    WheelSource,
    check_contracts,
    claimed_rows,
)
from afd_mrv2.compat.seam_check import module_paths
from afd_mrv2.compat.seams import ALL_SEAMS, SERVE_PARSER_IN_COMMON
from tests.compat.conftest import pinned_wheel

pytestmark = pytest.mark.ascend_vehicle

ASCEND_SEAMS = [s for s in ALL_SEAMS if s.distribution == "vllm-ascend"]
#: the vLLM seams a tree holding vllm_ascend checks: every one but the CPU-only ones
VLLM_ON_ASCEND = [s for s in ALL_SEAMS if s.distribution == "vllm" and (s.platforms is None or "ascend" in s.platforms)]
ROUTED = "vllm_ascend/ops/fused_moe/routed_experts.py"
FORWARD_IMPL = "vllm_ascend.ops.fused_moe.routed_experts.AscendRoutedExperts.forward_impl"
DBO_RESET = "vllm_config.parallel_config.enable_dbo = False"


@pytest.fixture(scope="module")
def wheel() -> Path:
    return pinned_wheel("0.30.0")


def _check(wheel: Path, ascend_root: Path) -> ContractReport:
    return check_contracts(StackSource([WheelSource(wheel), DirectorySource(ascend_root)]))


def _copy(ascend_src: Path, dest: Path, relpath: str, edit: Callable[[str], str]) -> Path:
    """The sdist's metadata and every module a vllm-ascend seam names, copied into ``dest``; ``edit`` on one."""
    (dest / "vllm_ascend.egg-info").mkdir(parents=True)
    shutil.copy(ascend_src / "vllm_ascend.egg-info" / "PKG-INFO", dest / "vllm_ascend.egg-info" / "PKG-INFO")
    wanted = {"vllm_ascend/__init__.py"} | {p for s in ASCEND_SEAMS for p in module_paths(s.module)}
    for rel in sorted(wanted):
        if (ascend_src / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            text = (ascend_src / rel).read_text(encoding="utf-8")
            (dest / rel).write_text(edit(text) if rel == relpath else text, encoding="utf-8")
    return dest


def test_every_contract_holds_against_the_vllm_0_30_0_wheel_and_the_sdist(wheel: Path, ascend_src: Path) -> None:
    report = _check(wheel, ascend_src)
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.ok and report.platform == "ascend" and report.absent == []
    assert report.versions == {"vllm": "0.30.0", "vllm-ascend": "0.30.0rc2"} and report.providers == {"vllm": "vllm"}
    assert report.checked == {"vllm": len(VLLM_ON_ASCEND), "vllm-ascend": len(ASCEND_SEAMS)}
    # what is not offered is what the row does not grant: the CUDA worker's factory and 0.33's parser module
    assert sorted(report.capabilities_missing) == [SERVE_PARSER_IN_COMMON, "worker_runner_factory"]
    # micro-batching: the seams hold (the patched initialize_kv_cache still builds upstream's ubatch runner)
    # but the platform switches DBO off and the model states assert micro-batch 0: the row withholds it
    assert report.blocked == {
        "ubatch_runner": [
            "vllm_ascend.platform._fix_incompatible_config",
            "vllm_ascend.worker.v2.model_states.default.AscendModelState.prepare_attn",
            "vllm_ascend.worker.v2.model_states.mamba_hybrid.AscendMambaHybridModelState.prepare_attn",
        ]
    }
    assert report.unblocked == {}
    [row] = claimed_rows(report)
    assert row.name == "ascend-0.30.0rc2" and row.capabilities == {"mrv2", "moe_seam"}
    assert dict(row.withheld).keys() == {"ubatch_runner"}


def test_a_renamed_ascend_seam_in_a_copy_fails_naming_it(
    wheel: Path, ascend_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The negative control: AscendRoutedExperts.forward_impl renamed in a copy of the unpacked tree."""
    copy = _copy(ascend_src, tmp_path, ROUTED, lambda t: t.replace("    def forward_impl(", "    def forward_routed("))
    report = _check(wheel, copy)
    assert report.checked == {"vllm": len(VLLM_ON_ASCEND), "vllm-ascend": len(ASCEND_SEAMS)}
    assert [str(v) for v in report.violations] == [
        f"{FORWARD_IMPL}: table row ascend-0.30.0rc2 grants 'moe_seam' but: AscendRoutedExperts.forward_impl is "
        "not defined in vllm_ascend.ops.fused_moe.routed_experts"
    ]
    assert main(["compat", "contracts", "--dist", str(wheel), "--dist", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"VIOLATION {FORWARD_IMPL}: table row ascend-0.30.0rc2 grants 'moe_seam'" in out
    assert "contracts: FAIL" in out


def test_a_copy_without_the_dbo_switch_off_contradicts_the_rows_ubatch_refusal(
    wheel: Path, ascend_src: Path, tmp_path: Path
) -> None:
    """Were vLLM-Ascend to stop resetting enable_dbo, the row's ubatch_runner line would be stale: a VIOLATION."""
    copy = _copy(ascend_src, tmp_path, "vllm_ascend/platform.py", lambda t: t.replace(DBO_RESET, "pass"))
    report = _check(wheel, copy)
    assert [str(v) for v in report.violations] == [
        "vllm_ascend.platform._fix_incompatible_config: table row ascend-0.30.0rc2 withholds 'ubatch_runner' "
        f"citing it, but: no longer runs `{DBO_RESET}`"
    ]
    assert len(report.blocked["ubatch_runner"]) == 2 and list(report.unblocked) == ["ubatch_runner"]
