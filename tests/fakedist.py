"""Fake installed distributions for compat tests: ``<name>-<version>.dist-info`` directories.

A directory made by :func:`make_site` and put first on ``sys.path`` (or ``PYTHONPATH``
for a subprocess) makes :mod:`importlib.metadata` report those versions, exactly as
for real installed distributions; nothing importable is created.
"""

from __future__ import annotations

from pathlib import Path


def make_site(root: Path, versions: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, version in versions.items():
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
    return root


def make_cann_info(root: Path, version: str) -> Path:
    path = root / "ascend_toolkit_install.info"
    path.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\narch=aarch64\n", encoding="utf-8")
    return path
