"""Read-only views of upstream source for the contracts: a directory, a wheel, or a stack of them.

A directory may be site-packages, a source checkout or an unpacked sdist (its version in
``<name>.egg-info/PKG-INFO`` or the root ``PKG-INFO``); a stack reads each path from the
first source that has it (``--dist vllm.whl --dist vllm_ascend-0.30.0rc2/``).
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Sequence
from email.parser import HeaderParser
from pathlib import Path

from afd_mrv2.compat.detect import VLLM_PROVIDERS

__all__ = ["DirectorySource", "Source", "StackSource", "WheelSource", "open_source", "open_sources", "vllm_provider"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Source:
    """Read-only access to ``.py`` files by path relative to the import root."""

    label: str

    def read(self, relpath: str) -> str | None:
        raise NotImplementedError

    def has_package(self, name: str) -> bool:
        return self.read(f"{name}/__init__.py") is not None

    def dist_version(self, distribution: str) -> str | None:
        """The version of ``distribution`` if the source carries its metadata (dist-info, egg-info, PKG-INFO)."""
        return None


class DirectorySource(Source):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.label = str(root)

    def read(self, relpath: str) -> str | None:
        path = self.root / relpath
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def dist_version(self, distribution: str) -> str | None:
        stem = distribution.replace("-", "_")
        for info in sorted(self.root.glob(f"{stem}-*.dist-info")):
            return info.name[len(stem) + 1 : -len(".dist-info")]
        candidates = [
            self.root / f"{stem}.egg-info" / "PKG-INFO",
            *sorted(self.root.glob(f"{stem}-*.egg-info/PKG-INFO")),
        ]
        for pkg_info in [*candidates, self.root / "PKG-INFO"]:
            if pkg_info.is_file():
                headers = HeaderParser().parsestr(pkg_info.read_text(encoding="utf-8", errors="replace"))
                if _canonical(headers.get("Name", "")) == _canonical(distribution) and headers.get("Version"):
                    return str(headers["Version"]).strip()
        return None


class WheelSource(Source):
    def __init__(self, path: Path) -> None:
        self.label = str(path)
        self._zip = zipfile.ZipFile(path)
        self._names = set(self._zip.namelist())

    def read(self, relpath: str) -> str | None:
        if relpath not in self._names:
            return None
        return self._zip.read(relpath).decode("utf-8")

    def dist_version(self, distribution: str) -> str | None:
        stem = distribution.replace("-", "_")
        pattern = re.compile(rf"^{re.escape(stem)}-([^/]+)\.dist-info/METADATA$")
        for name in sorted(self._names):
            match = pattern.match(name)
            if match:
                return match.group(1)
        return None


class StackSource(Source):
    """Several sources read as one: each path, and each distribution's version, from the first that has it."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self.label = " + ".join(s.label for s in sources)

    def read(self, relpath: str) -> str | None:
        return next((text for s in self.sources if (text := s.read(relpath)) is not None), None)

    def dist_version(self, distribution: str) -> str | None:
        return next((v for s in self.sources if (v := s.dist_version(distribution)) is not None), None)


def vllm_provider(source: Source) -> tuple[str, str] | None:
    """``(distribution, version)`` of the dist-info that shipped ``vllm`` in ``source``, if it carries one."""
    for dist in VLLM_PROVIDERS:
        version = source.dist_version(dist)
        if version:
            return dist, version
    return None


def open_source(path: str | Path) -> Source:
    """A :class:`Source` for a wheel file or a directory; ValueError for anything else."""
    path = Path(path)
    if path.is_file() and zipfile.is_zipfile(path):
        return WheelSource(path)
    if path.is_dir():
        return DirectorySource(path)
    raise ValueError(f"{path}: not a wheel (zip) or a directory")


def open_sources(paths: Sequence[str | Path]) -> Source:
    """One source for one path, a :class:`StackSource` for several (in the order given)."""
    if not paths:
        raise ValueError("no source given")
    sources = [open_source(p) for p in paths]
    return sources[0] if len(sources) == 1 else StackSource(sources)
