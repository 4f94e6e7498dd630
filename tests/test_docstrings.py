"""Module docstrings say what a module is in a few lines; the design they point to lives in docs/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "afd_mrv2"
MAX_MODULE_DOCSTRING_LINES = 12
#: ``docs/<page>.md``, optionally followed by ``, "<section>"`` (a heading, or the part of one before its colon)
DOCS_REF = re.compile(r"(docs/[\w./-]+?\.md)(?:,\s+\"([^\"]+)\")?")


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


def _docstrings(tree: ast.Module) -> list[str]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))]
    return [doc for doc in (ast.get_docstring(n) for n in nodes) if doc]


def _headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_module_docstring_is_at_most_12_lines() -> None:
    long = {}
    for path, tree in _trees():
        doc = ast.get_docstring(tree)
        if doc and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert long == {}, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the essay to docs/): {long}"


def test_every_docs_page_and_section_a_docstring_names_exists() -> None:
    refs = 0
    missing = []
    for path, tree in _trees():
        for doc in _docstrings(tree):
            for page_name, section in DOCS_REF.findall(" ".join(doc.split())):
                refs += 1
                page = ROOT / page_name
                if not page.is_file():
                    missing.append(f"{path.relative_to(ROOT)}: {page_name}")
                elif section and not any(h == section or h.startswith(section + ":") for h in _headings(page)):
                    missing.append(f'{path.relative_to(ROOT)}: {page_name}, "{section}"')
    assert refs >= 78  # every shortened module docstring points to its page
    assert missing == []


def test_the_checks_catch_a_long_docstring_and_a_missing_page(tmp_path: Path) -> None:
    doc = ast.get_docstring(ast.parse('"""' + "line\n" * 13 + '"""'))
    assert doc is not None and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES
    assert DOCS_REF.findall('See docs/internals/nowhere.md, "afd_mrv2.x".') == [
        ("docs/internals/nowhere.md", "afd_mrv2.x")
    ]
    assert not (ROOT / "docs/internals/nowhere.md").exists()
