"""The repository contract: README's commands and what CI runs agree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```sh\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readme_test_command_then_the_vllm_integration_command() -> None:
    main_job, tests, integration, ascend = readme_commands()[:4]
    assert tests.endswith("python -m pytest")
    assert integration.startswith("scripts/setup_vllm_cpu.sh && ")
    assert integration.endswith(" -m 'vllm_runtime and not vllm_full' tests/vllm")  # the reduced matrix
    assert ascend.startswith("scripts/setup_ascend_vehicle.sh && ") and ascend.endswith(" tests/ascend_vehicle")
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    # each command stops CI on failure (set -e does not stop inside an && chain)
    commands = [line.removesuffix(" || exit 1") for line in ci_lines if line.endswith(" || exit 1")]
    assert commands == ['cd "$(dirname "$0")/.."', tests, integration, ascend]
    assert "set -e" not in (ROOT / ".ci/run").read_text().replace("`set -e`", "")
    setup = main_job.rsplit("&&", 1)[0]
    assert tests.startswith(setup + "&&")  # the same set-up, then the checks and the tests


def test_readme_main_job_is_a_registered_command() -> None:
    from afd_mrv2.cli import COMMANDS

    main_job = readme_commands()[0]
    command = main_job.rsplit("&&", 1)[1].split()
    assert command[0] == "afd-mrv2" and command[1] in COMMANDS


def test_every_product_module_is_forbidden_to_import_test_support() -> None:
    """The import-linter contract lists every top-level module of afd_mrv2 except the test support itself,
    so a new module cannot import the test support (tests, tests/support) unnoticed."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split('name = "the product imports no test support', 1)[1].split("[[tool.importlinter", 1)[0]
    listed = set(re.findall(r'"(afd_mrv2\.\w+)"', block.split("forbidden_modules", 1)[0]))
    package = ROOT / "afd_mrv2"
    modules = {f"afd_mrv2.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {f"afd_mrv2.{p.parent.name}" for p in package.glob("*/__init__.py")}
    assert listed == modules


def test_readme_layers_are_the_import_linter_layers() -> None:
    """The README's layer list is the one lint-imports enforces (it had drifted: a removed package stayed listed)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"checked by `lint-imports` in the test\ncommand:\n\n```\n(.+?)\n```", text, re.S)
    assert block is not None, "README lost its layer list"
    pyproject = (ROOT / "pyproject.toml").read_text()
    listing = pyproject.split('type = "layers"', 1)[1].split("layers = [", 1)[1].split("]", 1)[0]
    layers = re.findall(r'"([^"]+)"', listing)
    assert block.group(1).splitlines() == [layer.replace("afd_mrv2.", "") for layer in layers]
