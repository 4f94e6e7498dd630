"""Documentation that cannot drift: every Python example in the README and docs/ is a file under
docs/examples/ that these tests run, and the text shows that file verbatim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
HEADER = re.compile(r"^# (docs/examples/[\w/]+\.py)\b")


def _blocks() -> list[tuple[Path, str]]:
    return [(page, m.group(1)) for page in PAGES for m in BLOCK.finditer(page.read_text())]


def test_every_python_block_is_an_example_file_shown_verbatim():
    blocks = _blocks()
    assert blocks, "no python examples found in the docs"
    shown = set()
    for page, code in blocks:
        header = HEADER.match(code)
        assert header, f"{page.relative_to(ROOT)}: a python block must start with '# docs/examples/NAME.py: ...'"
        path = ROOT / header.group(1)
        assert path.is_file(), f"{page.relative_to(ROOT)} shows {header.group(1)}, which does not exist"
        assert code == path.read_text(), f"{page.relative_to(ROOT)} shows {header.group(1)} differently from the file"
        shown.add(path)
    assert shown == set(EXAMPLES.glob("*.py")), "an example file no page shows"


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_runs(example):
    proc = subprocess.run([sys.executable, str(EXAMPLES / example)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert proc.stdout.strip(), "an example prints what it did"
