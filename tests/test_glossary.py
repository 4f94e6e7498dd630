"""docs/glossary.md against the code: the names it gives exist, and its retired words are gone but for their aliases."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
import sys
import typing
import warnings
from pathlib import Path

import pytest

from afd_mrv2 import envs
from afd_mrv2.cli import build_parser
from afd_mrv2.config import AfdConfig
from afd_mrv2.options import accepted_keys

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "afd_mrv2"
TEXT = (ROOT / "docs/glossary.md").read_text()
WORDS, RETIRED_PART = TEXT.split("## Retired words", 1)


def _table(part: str) -> list[list[str]]:
    rows = [line.strip().strip("|").split(" | ") for line in part.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # without the header


def _code(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


RETIRED = [(kind, *(_code(cell)[0] for cell in (old, new))) for kind, old, new, _ in _table(RETIRED_PART)]


def resolve(dotted: str) -> object:
    """The object ``afd_mrv2.x.y.Z.attr`` names (a dataclass field counts as an attribute of its class)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        break
    for attr in parts[cut:]:
        if (
            isinstance(obj, type)
            and dataclasses.is_dataclass(obj)
            and attr in {f.name for f in dataclasses.fields(obj)}
        ):
            return dataclasses.fields(obj)
        obj = getattr(obj, attr)
    return obj


def _option(command: str, flag: str) -> argparse.Action | None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next((a for a in sub.choices[command]._actions if flag in a.option_strings), None)


def _config_key(key: str) -> bool:
    """Whether ``afd.a.b`` is a key of the ``afd`` section (``a`` a section or option, ``b`` one of its keys)."""
    kind: type = AfdConfig
    *sections, last = key.split(".")[1:]
    for part in sections:
        field = accepted_keys(kind).get(part)
        hint = typing.get_type_hints(kind).get(field.name) if field is not None else None
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return False
        kind = hint
    return last in accepted_keys(kind)


def test_every_code_name_key_flag_and_variable_the_words_give_exists() -> None:
    names = _code(WORDS)
    dotted = [n for n in names if re.fullmatch(r"afd_mrv2(\.\w+)+", n)]
    keys = [n for n in names if re.fullmatch(r"afd(\.\w+)+", n)]
    flags = [n.split() for n in names if re.fullmatch(r"(run|demo|bench|serve) --[\w-]+( \w+)?", n)]
    variables = [n for n in names if re.fullmatch(r"AFD_MRV2_\w+", n)]
    assert len(dotted) >= 15 and len(keys) >= 6 and flags and envs.LAYOUT_LOG.name not in variables
    for name in dotted:
        resolve(name)  # raises when a name is gone
    assert [k for k in keys if not _config_key(k)] == []
    for command, flag, *_ in flags:
        option = _option(command, flag)
        assert option is not None and option.help != argparse.SUPPRESS, (command, flag)
    assert set(variables) <= {v.name for v in envs.VARIABLES}


def test_the_retired_table_covers_each_kind() -> None:
    assert {kind for kind, _, _ in RETIRED} == {"module", "attribute", "flag", "environment"}


def _package_trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


@pytest.mark.parametrize(("old", "new"), [(o, n) for k, o, n in RETIRED if k == "module"])
def test_a_retired_module_resolves_with_a_warning_and_the_package_no_longer_imports_it(
    old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated .*: import {re.escape(new)}"):
        retired = importlib.import_module(old)
    current = importlib.import_module(new)
    assert all(getattr(retired, n) is getattr(current, n) for n in current.__all__)
    inside = PACKAGE / old.removeprefix("afd_mrv2.").replace(".", "/")
    importers = []
    for path, tree in _package_trees():
        if path.is_relative_to(inside):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            if any(m == old or m.startswith(old + ".") for m in modules):
                importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert importers == []


@pytest.mark.parametrize(("old", "new"), [(o, n) for k, o, n in RETIRED if k == "attribute"])
def test_a_retired_attribute_is_only_its_deprecated_alias(old: str, new: str) -> None:
    resolve(new)
    owner, name = old.rsplit(".", 1)
    defining = Path(importlib.import_module(resolve(owner).__module__).__file__ or "")  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert name in vars(resolve(owner))  # still there, as an alias
    assert caught == []  # looking it up on the class does not call it
    uses = []
    for path, tree in _package_trees():
        for node in ast.walk(tree):
            used = isinstance(node, ast.Attribute) and node.attr == name
            defined = isinstance(node, ast.FunctionDef) and node.name == name and path != defining
            if used or defined:
                uses.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert uses == []


@pytest.mark.parametrize(("old", "new"), [(o, n) for k, o, n in RETIRED if k == "flag"])
def test_a_retired_flag_is_a_hidden_spelling_of_todays(old: str, new: str) -> None:
    command, old_flag = old.split()
    new_command, new_flag = new.split()
    retired, current = _option(command, old_flag), _option(new_command, new_flag)
    assert command == new_command and retired is not None and current is not None
    assert retired.help == argparse.SUPPRESS and current.help != argparse.SUPPRESS
    assert retired.dest == current.dest and getattr(retired, "spelling", None) == new_flag


@pytest.mark.parametrize(("old", "new"), [(o, n) for k, o, n in RETIRED if k == "environment"])
def test_a_retired_variable_is_read_only_through_the_registry(old: str, new: str) -> None:
    (var,) = [v for v in envs.VARIABLES if v.name == new]
    assert old in var.old_names
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated .*: set {new}"):
        assert var.raw({old: "1"}) == "1"
    literals = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, tree in _package_trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == old and path != PACKAGE / "envs.py"
    ]
    assert literals == []
