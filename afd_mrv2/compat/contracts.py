"""Check the declared upstream seams (:mod:`afd_mrv2.compat.seams`) against source, statically.

Parses an installed distribution or a wheel with :mod:`ast`; nothing is imported.

See docs/internals/compat.md, "afd_mrv2.compat.contracts".
"""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from afd_mrv2.compat.detect import VLLM_PROVIDERS, vllm_platform
from afd_mrv2.compat.seam_check import Violation, check_seam, module_paths
from afd_mrv2.compat.seams import ALL_SEAMS, Seam

__all__ = [
    "ContractReport",
    "DirectorySource",
    "Source",
    "Violation",
    "WheelSource",
    "check_contracts",
    "check_seam",
    "open_source",
]

_TOP = {"vllm": "vllm", "vllm-ascend": "vllm_ascend"}


class Source:
    """Read-only access to ``.py`` files by path relative to the import root."""

    label: str

    def read(self, relpath: str) -> str | None:
        raise NotImplementedError

    def has_package(self, name: str) -> bool:
        return self.read(f"{name}/__init__.py") is not None

    def dist_version(self, distribution: str) -> str | None:
        """The version in ``<name>-<version>.dist-info`` if the source carries one."""
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


@dataclass
class ContractReport:
    source: str
    checked: dict[str, int] = field(default_factory=dict)  # distribution -> seams checked
    absent: list[str] = field(default_factory=list)  # distributions not in the source
    violations: list[Violation] = field(default_factory=list)
    capabilities_missing: dict[str, list[str]] = field(default_factory=dict)  # capability -> messages
    versions: dict[str, str] = field(default_factory=dict)
    providers: dict[str, str] = field(default_factory=dict)  # package -> distribution that ships it
    platform: str | None = None  # the vLLM platform of the source (None: unknown, every seam checked)
    skipped: list[str] = field(default_factory=list)  # seams for other platforms
    _missing: dict[str, list[Violation]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return bool(self.checked) and not self.violations

    def as_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "ok": self.ok,
            "checked": self.checked,
            "absent": self.absent,
            "versions": self.versions,
            "providers": self.providers,
            "platform": self.platform,
            "skipped": self.skipped,
            "violations": [
                {"symbol": v.seam.symbol, "parameter": v.parameter, "message": v.message} for v in self.violations
            ],
            "capabilities_missing": self.capabilities_missing,
        }


def check_contracts(source: Source, seams: Iterable[Seam] = ALL_SEAMS) -> ContractReport:
    """Check every seam whose distribution's package is in ``source`` (and that applies to its platform)."""
    report = ContractReport(source=source.label)
    trees: dict[str, ast.Module | None] = {}
    present = {dist: source.has_package(top) for dist, top in _TOP.items()}
    report.absent = sorted(d for d, here in present.items() if not here)
    provider = vllm_provider(source) if present["vllm"] else None
    if provider is not None:
        report.providers["vllm"], report.versions["vllm"] = provider
        report.platform = vllm_platform(*provider)
    version = source.dist_version("vllm-ascend") if present["vllm-ascend"] else None
    if version:
        report.versions["vllm-ascend"] = version
    for seam in seams:
        if not present.get(seam.distribution, False):
            continue
        if seam.platforms is not None and report.platform is not None and report.platform not in seam.platforms:
            report.skipped.append(f"{seam.symbol} (only {', '.join(sorted(seam.platforms))})")
            continue
        report.checked[seam.distribution] = report.checked.get(seam.distribution, 0) + 1
        if seam.module not in trees:
            text = next((t for p in module_paths(seam.module) if (t := source.read(p)) is not None), None)
            trees[seam.module] = ast.parse(text, filename=seam.module) if text is not None else None
        tree = trees[seam.module]
        found = [Violation(seam, f"module {seam.module} is missing")] if tree is None else check_seam(seam, tree)
        if found and seam.capability is not None:
            report.capabilities_missing.setdefault(seam.capability, []).extend(str(v) for v in found)
            report._missing.setdefault(seam.capability, []).extend(found)
        else:
            report.violations += found
    _check_table_claims(report)
    return report


def _check_table_claims(report: ContractReport) -> None:
    """A table row may not claim a capability whose seams this very release lacks."""
    from afd_mrv2.compat.table import PAIRS
    from afd_mrv2.compat.versions import spec_matches

    version, provider = report.versions.get("vllm"), report.providers.get("vllm")
    for row in PAIRS:
        if row.vllm_ascend is not None or not row.status.accepted or row.distribution != provider:
            continue
        if row.platform != report.platform or not spec_matches(row.vllm, version):
            continue
        for capability, found in report._missing.items():
            if capability in row.capabilities:
                report.violations += [
                    Violation(v.seam, f"table row {row.name} grants {capability!r} but: {v.message}", v.parameter)
                    for v in found
                ]
