"""afd_mrv2.testing is opt-in test support: no product module imports it, not even lazily."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import afd_mrv2

PACKAGE = Path(afd_mrv2.__file__).resolve().parent
TESTING = "afd_mrv2.testing"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_testing(name: str) -> bool:
    return name == TESTING or name.startswith(TESTING + ".")


def imports_of_testing(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Every place in ``source`` that imports afd_mrv2.testing, at any depth, as ``line: what``.

    Covers ``import``, ``from ... import`` (relative ones resolved against
    ``module``) and a string naming the package passed to any call
    (``importlib.import_module``, ``__import__``).
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        found += [f"{node.lineno}: {name}" for name in names if _is_testing(name)][:1]
    return found


def product_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if (PACKAGE / "testing") not in p.parents)


def test_no_product_module_imports_the_test_support() -> None:
    modules = product_modules()
    assert len(modules) > 50 and PACKAGE / "pipeline" / "executor.py" in modules
    offenders = {
        module_name(path): hits
        for path in modules
        if (
            hits := imports_of_testing(
                path.read_text(encoding="utf-8"), module_name(path), is_package=path.name == "__init__.py"
            )
        )
    }
    assert offenders == {}, f"product modules import {TESTING}: {offenders}"


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import afd_mrv2.testing.cam_fabric", "afd_mrv2.probe.cluster"),
        ("from afd_mrv2 import testing", "afd_mrv2.probe.cluster"),
        ("def f():\n    from afd_mrv2.testing.happens_before import check_happens_before\n", "afd_mrv2.cli.run"),
        ("class A:\n    def m(self):\n        from ..testing import probe_doubles\n", "afd_mrv2.probe.cluster"),
        ("from .. import testing", "afd_mrv2.probe.cluster"),
        ("import importlib\nimportlib.import_module('afd_mrv2.testing.camp2p_doubles')", "afd_mrv2.bench.grid"),
        ("__import__('afd_mrv2.testing')", "afd_mrv2.bench.grid"),
    ],
)
def test_the_check_sees_every_way_of_importing(source: str, module: str) -> None:
    assert len(imports_of_testing(source, module)) == 1


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import afd_mrv2.testingx", "afd_mrv2.bench.grid"),
        ("from afd_mrv2.hooks.cam import common", "afd_mrv2.probe.cluster"),
        ("from . import testing", "afd_mrv2.probe.cluster"),  # afd_mrv2.probe.testing, another module
        ("x = 'see afd_mrv2.testing'", "afd_mrv2.bench.grid"),  # a mention, not a call
    ],
)
def test_the_check_passes_what_is_not_an_import_of_it(source: str, module: str) -> None:
    assert imports_of_testing(source, module) == []


def test_the_docstring_names_every_support_module() -> None:
    import afd_mrv2.testing

    doc = afd_mrv2.testing.__doc__ or ""
    for path in sorted((PACKAGE / "testing").glob("*.py")):
        if path.name != "__init__.py":
            assert f":mod:`afd_mrv2.testing.{path.stem}`" in doc, path.stem
    assert "nothing in the product" in doc and "imports it" in doc
