"""Check the declared upstream seams (:mod:`afd_mrv2.compat.seams`) against source, statically.

Parses an installed distribution or a wheel with :mod:`ast`; nothing is imported.

See docs/internals/compat.md, "afd_mrv2.compat.contracts".
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field

from afd_mrv2.compat.detect import stack_platform
from afd_mrv2.compat.seam_check import Violation, check_seam, module_paths
from afd_mrv2.compat.seams import ALL_SEAMS, Seam
from afd_mrv2.compat.sources import (
    DirectorySource,
    Source,
    StackSource,
    WheelSource,
    open_source,
    open_sources,
    vllm_provider,
)
from afd_mrv2.compat.table import PAIRS, RuntimePair
from afd_mrv2.compat.versions import spec_matches

__all__ = [
    "ContractReport",
    "DirectorySource",
    "Source",
    "StackSource",
    "Violation",
    "WheelSource",
    "check_contracts",
    "check_seam",
    "open_source",
    "open_sources",
]

_TOP = {"vllm": "vllm", "vllm-ascend": "vllm_ascend"}


@dataclass
class ContractReport:
    source: str
    checked: dict[str, int] = field(default_factory=dict)  # distribution -> seams checked
    absent: list[str] = field(default_factory=list)  # distributions not in the source
    violations: list[Violation] = field(default_factory=list)
    capabilities_missing: dict[str, list[str]] = field(default_factory=dict)  # capability -> messages
    versions: dict[str, str] = field(default_factory=dict)
    providers: dict[str, str] = field(default_factory=dict)  # package -> distribution that ships it
    platform: str | None = None  # the platform of the source (None: unknown, every seam checked)
    skipped: list[str] = field(default_factory=list)  # seams for other platforms
    blocked: dict[str, list[str]] = field(default_factory=dict)  # capability -> upstream facts that withhold it
    unblocked: dict[str, list[str]] = field(default_factory=dict)  # capability -> blocking facts now gone
    _missing: dict[str, list[Violation]] = field(default_factory=dict, repr=False)
    _blockers: dict[str, list[Seam]] = field(default_factory=dict, repr=False)
    _gone: dict[str, list[Violation]] = field(default_factory=dict, repr=False)

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
            "blocked": self.blocked,
            "unblocked": self.unblocked,
        }

    def record(self, seam: Seam, found: list[Violation]) -> None:
        """File one checked seam's violations: a blocking fact, a capability not offered, or a violation."""
        if seam.blocks is not None:
            if found:
                self.unblocked.setdefault(seam.blocks, []).extend(str(v) for v in found)
                self._gone.setdefault(seam.blocks, []).extend(found)
            else:
                self.blocked.setdefault(seam.blocks, []).append(seam.symbol)
                self._blockers.setdefault(seam.blocks, []).append(seam)
        elif found and seam.capability is not None:
            self.capabilities_missing.setdefault(seam.capability, []).extend(str(v) for v in found)
            self._missing.setdefault(seam.capability, []).extend(found)
        else:
            self.violations += found


def _identify(source: Source, report: ContractReport) -> dict[str, bool]:
    """Which distributions' packages ``source`` holds; fills the report's versions, providers and platform."""
    present = {dist: source.has_package(top) for dist, top in _TOP.items()}
    report.absent = sorted(d for d, here in present.items() if not here)
    provider = vllm_provider(source) if present["vllm"] else None
    if provider is not None:
        report.providers["vllm"], report.versions["vllm"] = provider
    version = source.dist_version("vllm-ascend") if present["vllm-ascend"] else None
    if version:
        report.versions["vllm-ascend"] = version
    distribution, vllm = provider if provider is not None else (None, None)
    # vllm_ascend without its metadata (a stand-in, a bare copy): the platform is unknown, every seam is checked
    unknown = present["vllm-ascend"] and not version
    report.platform = None if unknown else stack_platform(distribution, vllm, vllm_ascend=version)
    return present


def check_contracts(
    source: Source, seams: Iterable[Seam] = ALL_SEAMS, *, pairs: tuple[RuntimePair, ...] = PAIRS
) -> ContractReport:
    """Check every seam whose distribution's package is in ``source`` (and that applies to its platform), then
    the claims of the table rows (``pairs``) that describe the release."""
    report = ContractReport(source=source.label)
    trees: dict[str, ast.Module | None] = {}
    present = _identify(source, report)
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
        report.record(
            seam, [Violation(seam, f"module {seam.module} is missing")] if tree is None else check_seam(seam, tree)
        )
    for row in claimed_rows(report, pairs):
        report.violations += _row_claim_violations(row, report)
    return report


def claimed_rows(report: ContractReport, pairs: tuple[RuntimePair, ...] = PAIRS) -> list[RuntimePair]:
    """The accepted table rows that describe the release in the report (by its dist-info/egg-info versions)."""
    versions = report.versions
    return [
        row
        for row in pairs
        if row.status.accepted
        and row.distribution == report.providers.get("vllm")
        and row.platform == report.platform
        and spec_matches(row.vllm, versions.get("vllm"))
        and (row.vllm_ascend is None or spec_matches(row.vllm_ascend, versions.get("vllm-ascend")))
    ]


def _row_claim_violations(row: RuntimePair, report: ContractReport) -> list[Violation]:
    """A row may not grant a capability whose seams this release lacks or that an upstream fact blocks, nor
    withhold one citing a blocking fact the release no longer has."""
    out: list[Violation] = []
    for capability, found in report._missing.items():
        if capability in row.capabilities:
            out += [
                Violation(v.seam, f"table row {row.name} grants {capability!r} but: {v.message}", v.parameter)
                for v in found
            ]
    for capability, blockers in report._blockers.items():
        if capability in row.capabilities:
            out += [
                Violation(s, f"table row {row.name} grants {capability!r} but upstream blocks it: {s.why}")
                for s in blockers
            ]
    withheld = dict(row.withheld)
    for capability, gone in report._gone.items():
        if capability in withheld:
            out += [
                Violation(
                    v.seam, f"table row {row.name} withholds {capability!r} citing it, but: {v.message}", v.parameter
                )
                for v in gone
            ]
    return out
