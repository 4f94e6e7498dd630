"""The test support (tests/, its CAM doubles and happens-before oracle in tests/support) is not product code:
no module of afd_mrv2 imports it, not even lazily (the import-linter contract sees only static imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import afd_mrv2

PACKAGE = Path(afd_mrv2.__file__).resolve().parent
TESTING = "tests"


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
    """Every place in ``source`` that imports tests.support, at any depth, as ``line: what``.

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
    return sorted(PACKAGE.rglob("*.py"))


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
        ("import tests.support.cam_fabric", "afd_mrv2.probe.cluster"),
        ("from tests import support", "afd_mrv2.probe.cluster"),
        ("def f():\n    from tests.support.happens_before import check_happens_before\n", "afd_mrv2.cli.run"),
        ("class A:\n    def m(self):\n        from tests.support import probe_doubles\n", "afd_mrv2.probe.cluster"),
        ("import importlib\nimportlib.import_module('tests.support.camp2p_doubles')", "afd_mrv2.bench.grid"),
        ("__import__('tests.support')", "afd_mrv2.bench.grid"),
    ],
)
def test_the_check_sees_every_way_of_importing(source: str, module: str) -> None:
    assert len(imports_of_testing(source, module)) == 1


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import testsx", "afd_mrv2.bench.grid"),
        ("from afd_mrv2.hooks.cam import common", "afd_mrv2.probe.cluster"),
        ("from . import tests", "afd_mrv2.probe.cluster"),  # afd_mrv2.probe.tests, another module
        ("x = 'see tests.support'", "afd_mrv2.bench.grid"),  # a mention, not a call
    ],
)
def test_the_check_passes_what_is_not_an_import_of_it(source: str, module: str) -> None:
    assert imports_of_testing(source, module) == []


def test_the_docstring_names_every_support_module() -> None:
    import tests.support

    doc = tests.support.__doc__ or ""
    for path in sorted(Path(tests.support.__file__).parent.glob("*.py")):
        if path.name != "__init__.py":
            assert f":mod:`tests.support.{path.stem}`" in doc, path.stem
    assert "nothing in the product" in doc and "imports it" in doc
