"""Check one :class:`~afd_mrv2.compat.seam.Seam` against one parsed upstream module (:mod:`ast`, no import).

Parameter rule for functions: every parameter the seam names exists, the
positional ones in the same relative order, and every parameter upstream has that
the seam does not name has a default (else afd-mrv2's calls would break).

``self_reads`` is an upper bound: the ``self`` attributes an inherited upstream
method may read.  afd-mrv2's micro-batch runner sets the attributes upstream's
``UBatchRunner.prepare``/``run`` read instead of calling upstream's constructor,
so a method that starts reading one more attribute is a violation naming it.
``names`` on a class seam: names its body must bind (methods, fields, enum members);
``statements``, ``entries``, ``literals``: see docs/internals/compat.md, "afd_mrv2.compat.seams".
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass

from afd_mrv2.compat.seam import Seam


@dataclass(frozen=True)
class Violation:
    seam: Seam
    message: str
    parameter: str | None = None

    def __str__(self) -> str:
        return f"{self.seam.symbol}: {self.message}"


# --------------------------------------------------------------------------- AST lookups


def module_paths(module: str) -> list[str]:
    """Where ``module``'s source may be, relative to the import root."""
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
    node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef = tree
    parent_is_class = False
    for part in qualname.split("."):
        found = None
        for child in _body_defs(node.body):
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


def _class_names(cls: ast.ClassDef) -> set[str]:
    """Names a class body binds: methods, nested classes, assigned and annotated names (enum members too)."""
    names = _class_fields(cls)
    for node in cls.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _self_reads(fn: ast.AST) -> set[str]:
    """``self`` attributes a definition reads (nested functions included; stores excluded)."""
    return {
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Load)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }


def _module_constant(tree: ast.Module, name: str) -> object:
    for node in _body_defs(tree.body):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value.value
    return None


def _module_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in _body_defs(tree.body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _has_main_guard(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
        for node in tree.body
    )


def _referenced(node: ast.AST) -> set[str]:
    """Identifiers a definition references: names, attribute names, imported names and modules."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            out.update(a.name.rsplit(".", 1)[-1] for a in sub.names)
    return out


def _decorator_names(node: ast.AST) -> list[str]:
    out = []
    for dec in getattr(node, "decorator_list", []):
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Name):
            out.append(target.id)
        elif isinstance(target, ast.Attribute):
            out.append(target.attr)
    return out


_COMPOUND: tuple[type[ast.stmt], ...] = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For)
_COMPOUND += (ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match)


def _statements(node: ast.AST) -> set[str]:
    """The simple statements anywhere in ``node`` as ``ast.unparse`` writes them; an assert also without its message."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.stmt) and not isinstance(sub, _COMPOUND):
            out.add(ast.unparse(sub))
            if isinstance(sub, ast.Assert):
                out.add(f"assert {ast.unparse(sub.test)}")
    return out


def _entries(node: ast.AST) -> set[tuple[str, str]]:
    """``(key, value source)`` of every string-keyed item of a dict literal anywhere in ``node``."""
    return {
        (key.value, ast.unparse(value))
        for sub in ast.walk(node)
        if isinstance(sub, ast.Dict)
        for key, value in zip(sub.keys, sub.values, strict=True)
        if isinstance(key, ast.Constant) and isinstance(key.value, str)
    }


def _check_body_text(seam: Seam, node: ast.AST) -> list[Violation]:
    """The statements, dict-literal entries and string constants the seam expects anywhere in ``node``."""
    out: list[Violation] = []
    if seam.statements:
        held = _statements(node)
        out += [Violation(seam, f"no longer runs `{s}`", s) for s in seam.statements if s not in held]
    if seam.entries:
        items = _entries(node)
        for key, value in seam.entries:
            if (key, value) not in items:
                out.append(Violation(seam, f"no longer maps {key!r} to {value}", key))
    if seam.literals:
        held = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        out += [Violation(seam, f"no longer holds the string {s!r}", s) for s in seam.literals if s not in held]
    return out


def _check_module(seam: Seam, tree: ast.Module) -> list[Violation]:
    bound = _module_names(tree)
    out = [Violation(seam, f"module-level name {n!r} is missing", n) for n in seam.names if n not in bound]
    if seam.runnable and not _has_main_guard(tree):
        out.append(Violation(seam, 'has no `if __name__ == "__main__":` block (python -m no longer runs it)'))
    return out + _check_body_text(seam, tree)


def _check_constant(seam: Seam, tree: ast.Module, name: str, expected: object) -> list[Violation]:
    actual = _module_constant(tree, name)
    if actual == expected:
        return []
    return [Violation(seam, f"module constant {name} is {actual!r}, expected {expected!r}")]


def _check_references(seam: Seam, node: ast.AST) -> list[Violation]:
    """The decorators, referenced names and ``self`` reads the seam expects of a definition."""
    out: list[Violation] = []
    decorators = _decorator_names(node)
    for name in seam.decorators:
        if name not in decorators:
            out.append(Violation(seam, f"is no longer decorated with @{name} (has: {', '.join(decorators) or 'none'})"))
    if seam.uses:
        referenced = _referenced(node)
        out += [Violation(seam, f"no longer references {name!r}", name) for name in seam.uses if name not in referenced]
    if seam.self_reads is not None:
        listed = ", ".join(seam.self_reads) or "nothing"
        for name in sorted(_self_reads(node) - set(seam.self_reads)):
            out.append(Violation(seam, f"now reads self.{name} (the contract allows only: {listed})", name))
    return out


def _check_assigns(seam: Seam, node: ast.AST) -> list[Violation]:
    if not seam.assigns:
        return []
    assigned = _self_assigned(node)
    return [Violation(seam, f"no longer assigns self.{name}", name) for name in seam.assigns if name not in assigned]


def _check_class(seam: Seam, node: ast.ClassDef) -> list[Violation]:
    """The class-level names, bases and fields the seam expects of a class."""
    members = _class_names(node)
    out = [Violation(seam, f"class-level name {name!r} is missing", name) for name in seam.names if name not in members]
    bases = _base_names(node)
    for base in seam.bases:
        if base not in bases:
            out.append(Violation(seam, f"no longer derives from {base} (bases: {', '.join(bases) or 'none'})"))
    fields = _class_fields(node)
    out += [Violation(seam, f"class field {name!r} is missing", name) for name in seam.fields if name not in fields]
    return out


def _check_definition(seam: Seam, node: ast.AST, bound: bool) -> list[Violation]:
    """Violations of a seam on a class, function or method definition."""
    out = _check_references(seam, node) + _check_body_text(seam, node)
    if seam.params is not None:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [Violation(seam, "expected a function or method")]
        out += _check_params(seam, node, bound)
    out += _check_assigns(seam, node)
    if seam.bases or seam.fields or seam.names:
        if not isinstance(node, ast.ClassDef):
            return [*out, Violation(seam, "expected a class")]
        out += _check_class(seam, node)
    return out


def check_seam(seam: Seam, tree: ast.Module) -> list[Violation]:
    """Violations of one seam in one parsed module."""
    if not seam.qualname:
        return _check_module(seam, tree)
    if seam.constant is not None:
        return _check_constant(seam, tree, *seam.constant)
    node, bound = _find(tree, seam.qualname)
    if node is None:
        return [Violation(seam, f"{seam.qualname} is not defined in {seam.module}")]
    return _check_definition(seam, node, bound)
