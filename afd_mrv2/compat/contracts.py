"""Check the declared upstream seams (:mod:`afd_mrv2.compat.seams`) against source, statically.

The source is an installed distribution (a ``site-packages`` directory or a source
checkout holding ``vllm/`` and/or ``vllm_ascend/``) or a wheel (a zip).  Files are
parsed with :mod:`ast`; nothing is imported or executed, so a 336 MB vLLM wheel can
be checked on a CPU-only CI machine.

Parameter rule for functions: every parameter the seam names exists, the
positional ones in the same relative order, and every parameter upstream has that
the seam does not name has a default (else afd-mrv2's calls would break).
"""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from afd_mrv2.compat.seams import SEAMS, Seam

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


def open_source(path: str | Path) -> Source:
    """A :class:`Source` for a wheel file or a directory; ValueError for anything else."""
    path = Path(path)
    if path.is_file() and zipfile.is_zipfile(path):
        return WheelSource(path)
    if path.is_dir():
        return DirectorySource(path)
    raise ValueError(f"{path}: not a wheel (zip) or a directory")


@dataclass(frozen=True)
class Violation:
    seam: Seam
    message: str
    parameter: str | None = None

    def __str__(self) -> str:
        return f"{self.seam.symbol}: {self.message}"


@dataclass
class ContractReport:
    source: str
    checked: dict[str, int] = field(default_factory=dict)  # distribution -> seams checked
    absent: list[str] = field(default_factory=list)  # distributions not in the source
    violations: list[Violation] = field(default_factory=list)
    capabilities_missing: dict[str, list[str]] = field(default_factory=dict)  # capability -> messages
    versions: dict[str, str] = field(default_factory=dict)

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
            "violations": [
                {"symbol": v.seam.symbol, "parameter": v.parameter, "message": v.message} for v in self.violations
            ],
            "capabilities_missing": self.capabilities_missing,
        }


# --------------------------------------------------------------------------- AST lookups


def _module_paths(module: str) -> list[str]:
    base = module.replace(".", "/")
    return [f"{base}.py", f"{base}/__init__.py"]


def _body_defs(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Definitions in a body, looking through module-level if/try blocks."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            yield from _body_defs(node.body)
            yield from _body_defs(node.orelse)
            if isinstance(node, ast.Try):
                for handler in node.handlers:
                    yield from _body_defs(handler.body)
        else:
            yield node


def _find(tree: ast.Module, qualname: str) -> tuple[ast.AST | None, bool]:
    """The node for ``qualname`` and whether it is a method (first parameter bound)."""
    node: ast.AST = tree
    parent_is_class = False
    for part in qualname.split("."):
        found = None
        for child in _body_defs(node.body):  # type: ignore[attr-defined]
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == part:
                found = child  # the last definition wins, as at run time
        if found is None:
            return None, False
        parent_is_class = isinstance(node, ast.ClassDef)
        node = found
    return node, parent_is_class and not _is_static(node)


def _is_static(node: ast.AST) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in decorators)


def _check_params(seam: Seam, fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> list[Violation]:
    args = fn.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    n_defaults = len(args.defaults)
    pos_required = set(positional[: len(positional) - n_defaults]) if n_defaults else set(positional)
    if bound and positional:
        pos_required.discard(positional[0])
        positional = positional[1:]
    kwonly = [a.arg for a in args.kwonlyargs]
    kw_required = {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None}
    available = positional + kwonly
    shown = ", ".join(available) or "no parameters"
    out: list[Violation] = []
    assert seam.params is not None
    for name in seam.params:
        if name not in available:
            out.append(Violation(seam, f"parameter {name!r} is missing (upstream has: {shown})", name))
    order = [positional.index(n) for n in seam.params if n in positional]
    if order != sorted(order):
        out.append(
            Violation(seam, f"positional parameters {', '.join(seam.params)} changed order (upstream has: {shown})")
        )
    for name in available:
        if name not in seam.params and (name in pos_required or name in kw_required):
            out.append(Violation(seam, f"upstream added the required parameter {name!r} (upstream has: {shown})", name))
    return out


def _self_assigned(fn: ast.AST) -> set[str]:
    names: set[str] = set()

    def targets(node: ast.AST) -> Iterable[ast.AST]:
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                yield from targets(elt)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)
        else:
            yield node

    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            candidates = [t for target in node.targets for t in targets(target)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            candidates = list(targets(node.target))
        else:
            continue
        for target in candidates:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def _base_names(cls: ast.ClassDef) -> list[str]:
    out = []
    for base in cls.bases:
        if isinstance(base, ast.Name):
            out.append(base.id)
        elif isinstance(base, ast.Attribute):
            out.append(base.attr)
    return out


def _class_fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _module_constant(tree: ast.Module, name: str) -> object:
    for node in _body_defs(tree.body):
        named = isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        if named and isinstance(node.value, ast.Constant):  # type: ignore[union-attr]
            return node.value.value  # type: ignore[union-attr]
    return None


def check_seam(seam: Seam, tree: ast.Module) -> list[Violation]:
    """Violations of one seam in one parsed module."""
    if seam.constant is not None:
        name, expected = seam.constant
        actual = _module_constant(tree, name)
        return (
            []
            if actual == expected
            else [Violation(seam, f"module constant {name} is {actual!r}, expected {expected!r}")]
        )
    node, bound = _find(tree, seam.qualname)
    if node is None:
        return [Violation(seam, f"{seam.qualname} is not defined in {seam.module}")]
    out: list[Violation] = []
    if seam.params is not None:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [Violation(seam, "expected a function or method")]
        out += _check_params(seam, node, bound)
    if seam.assigns:
        assigned = _self_assigned(node)
        for name in seam.assigns:
            if name not in assigned:
                out.append(Violation(seam, f"no longer assigns self.{name}", name))
    if seam.bases or seam.fields:
        if not isinstance(node, ast.ClassDef):
            return [*out, Violation(seam, "expected a class")]
        bases = _base_names(node)
        for base in seam.bases:
            if base not in bases:
                out.append(Violation(seam, f"no longer derives from {base} (bases: {', '.join(bases) or 'none'})"))
        fields = _class_fields(node)
        for name in seam.fields:
            if name not in fields:
                out.append(Violation(seam, f"class field {name!r} is missing", name))
    return out


def check_contracts(source: Source, seams: Iterable[Seam] = SEAMS) -> ContractReport:
    """Check every seam whose distribution's package is in ``source``."""
    report = ContractReport(source=source.label)
    trees: dict[str, ast.Module | None] = {}
    present = {dist: source.has_package(top) for dist, top in _TOP.items()}
    report.absent = sorted(d for d, here in present.items() if not here)
    for dist, here in present.items():
        version = source.dist_version(dist) if here else None
        if version:
            report.versions[dist] = version
    for seam in seams:
        if not present.get(seam.distribution, False):
            continue
        report.checked[seam.distribution] = report.checked.get(seam.distribution, 0) + 1
        if seam.module not in trees:
            text = next((t for p in _module_paths(seam.module) if (t := source.read(p)) is not None), None)
            trees[seam.module] = ast.parse(text, filename=seam.module) if text is not None else None
        tree = trees[seam.module]
        found = [Violation(seam, f"module {seam.module} is missing")] if tree is None else check_seam(seam, tree)
        if found and seam.capability is not None:
            report.capabilities_missing.setdefault(seam.capability, []).extend(str(v) for v in found)
        else:
            report.violations += found
    _check_table_claims(report)
    return report


def _check_table_claims(report: ContractReport) -> None:
    """A table row may not claim a capability whose seams this very release lacks."""
    from afd_mrv2.compat.table import PAIRS
    from afd_mrv2.compat.versions import spec_matches

    version = report.versions.get("vllm")
    for row in PAIRS:
        if row.vllm_ascend is not None or not row.status.accepted or not spec_matches(row.vllm, version):
            continue
        for capability, messages in report.capabilities_missing.items():
            if capability in row.capabilities:
                seam = next(s for s in SEAMS if s.capability == capability)
                report.violations.append(
                    Violation(seam, f"table row {row.name} grants {capability!r} but: {'; '.join(messages)}")
                )
