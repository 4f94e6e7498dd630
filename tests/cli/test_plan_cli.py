"""``afd-mrv2 plan``: the table and ``--json`` on the real configs, ``--device-memory`` refusals and bad input
(each a one-line error, exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from afd_mrv2.checkpoints.sizing import plan_roles, size_checkpoint
from afd_mrv2.cli import main
from afd_mrv2.cli.plan import GIB, parse_size

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
DSV3 = str(CONFIGS / "DeepSeek-V3")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_table_names_each_role_and_the_json_has_exact_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, DSV3, "--attention", "2", "--ffn", "8", "--expert-replicas", "2")
    assert code == 0
    assert "DeepSeek-V3 (deepseek_v3, from config.json: fp8 linear weights" in out
    assert "671.03 B parameters" in out and "(1 MTP layer left out)" in out
    assert "role       ranks  experts each  weights each  reads at start\n" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("attention ", "ffn "))}
    assert rows["attention"][1:] == ["0-1", "0", "17.77", "GiB", "17.92", "GiB"]
    assert rows["ffn"][1:] == ["0-7", "64", "152.29", "GiB", "170.17", "GiB"]
    assert "today" not in out and "peak" not in out
    code, out, _ = run(capsys, DSV3, "--attention", "2", "--ffn", "8", "--expert-replicas", "2", "--json")
    report = json.loads(out)
    plans = plan_roles(size_checkpoint(DSV3), 2, 8, 2)
    assert [r["ranks"] for r in report["roles"]] == [[0, 1], list(range(8))]
    assert set(report["roles"][1]) == {
        "role",
        "ranks",
        "experts_each",
        "routed_expert_bytes",
        "weight_bytes",
        "read_bytes",
    }
    assert [r["weight_bytes"] for r in report["roles"]] == [p.weights for p in plans]
    assert [r["read_bytes"] for r in report["roles"]] == [p.reads for p in plans]
    assert report["total_bytes"] == sum(report["kinds"].values())
    rest, scales = report["total_bytes"] - report["kinds"]["routed_experts"], report["routed_expert_scale_bytes"]
    ffn = report["roles"][1]
    assert report["roles"][0]["weight_bytes"] == rest and ffn["weight_bytes"] == ffn["routed_expert_bytes"]
    assert (
        ffn["read_bytes"] == rest + ffn["weight_bytes"] + scales * 3 // 4
    )  # holds R/F = 1/4; the others' scales read too
    assert (report["parameters"], report["mtp_layers_left_out"]) == (671_026_419_200, 1)


@pytest.mark.parametrize(
    ("text", "size"),
    [("64GiB", 64 * GIB), ("64 GiB", 64 * GIB), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000)],
)
def test_sizes_parse_in_binary_and_decimal_units(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_a_plan_that_does_not_fit_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device-memory`` checks the weights each role holds (Qwen3: Attention 14.90 GiB, FFN 52.88 GiB)."""
    qwen = str(CONFIGS / "Qwen3-235B-A22B")
    code, out, err = run(capsys, qwen, "--attention", "1", "--ffn", "8", "--device-memory", "50GiB")
    assert (code, out) == (2, "")
    assert err == (
        "afd-mrv2 plan: error: plan does not fit --device-memory 50.00 GiB (weights held): "
        "ffn ranks 0-7 need 52.88 GiB each, 2.88 GiB over\n"
    )
    code, out, err = run(capsys, qwen, "--attention", "1", "--ffn", "8", "--device-memory", "53GiB")
    assert (code, err) == (0, "") and "ffn          0-7            16     52.88 GiB" in out
    code, _, err = run(capsys, qwen, "--attention", "1", "--ffn", "8", "--device-memory", "14GiB")
    assert code == 2 and err.count("\n") == 1
    assert "attention rank 0 needs 14.90 GiB, 0.90 GiB over; ffn ranks 0-7 need 52.88 GiB each" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ffn", "0"], "need at least one FFN rank, got 0"),
        (["--ffn", "4", "--expert-replicas", "5"], "expert_replicas must be in 1..4 (the FFN ranks), got 5"),
        (["--ffn", "300"], "num_experts (256) must be at least the FFN ranks (300)"),
        (["--ffn", "2", "--attention", "0"], "--attention: expected an integer >= 1, got 0"),
        (["--ffn", "2", "--device-memory", "lots"], "--device-memory: expected a size such as 64GiB"),
    ],
)
def test_bad_numbers_are_one_line_errors(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    argv = ["--attention", "1", *args] if "--attention" not in args else args
    code, out, err = run(capsys, DSV3, *argv)
    assert (code, out, err.count("\n")) == (2, "", 1)
    assert message in err


def test_a_folder_without_config_or_of_an_unknown_architecture_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, str(tmp_path), "--attention", "1", "--ffn", "1")
    assert (code, err) == (2, f"afd-mrv2 plan: error: MODEL: no config.json in {tmp_path}\n")
    shutil.copy(CONFIGS / "Qwen3-235B-A22B" / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    code, _, err = run(capsys, str(tmp_path), "--attention", "1", "--ffn", "1")
    assert code == 2 and err.count("\n") == 1
    assert "config.json: model_type: expected one of deepseek_v2, deepseek_v3, kimi_k2" in err and "'llama'" in err
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    code, _, err = run(capsys, str(tmp_path), "--attention", "1", "--ffn", "1")
    assert code == 2 and "quant_method 'awq' is not sized here (known: fp8)" in err
    del config["moe_intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, str(tmp_path), "--attention", "1", "--ffn", "1")
    assert (code, err.count("\n")) == (2, 1)
    assert "cannot size this qwen3_moe: it has no 'moe_intermediate_size' key" in err


def test_fit_is_gone(capsys: pytest.CaptureFixture[str]) -> None:
    """``--fit`` (added and removed within 0.3.0, unreleased): there is one layout, what each role holds."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", DSV3, "--attention", "1", "--ffn", "2", "--fit", "experts-only"])
    assert exit_.value.code == 2 and "unrecognized arguments: --fit experts-only" in capsys.readouterr().err
