"""One upstream seam, declared as data (see :mod:`afd_mrv2.compat.seams` for the lists).

A seam with ``blocks`` is the opposite of a reliance: an upstream fact that keeps a
capability from a table row (the row's ``withheld`` line cites it); see
docs/internals/compat.md, "Blocking seams".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Seam:
    distribution: str  # "vllm" | "vllm-ascend"
    module: str
    qualname: str
    why: str
    params: tuple[str, ...] | None = None  # required parameter names in order (self/cls excluded)
    assigns: tuple[str, ...] = ()  # attributes the function assigns on self
    bases: tuple[str, ...] = ()  # base class names (last dotted component)
    fields: tuple[str, ...] = ()  # annotated class-level fields
    constant: tuple[str, str] | None = None  # module-level NAME = "value"
    capability: str | None = None
    platforms: frozenset[str] | None = None  # vLLM platforms it applies to (None: every one)
    names: tuple[str, ...] = ()  # names the module (qualname "") or the class body must bind
    uses: tuple[str, ...] = ()  # identifiers the definition's body must reference (names, attributes, imports)
    decorators: tuple[str, ...] = ()  # decorator names, e.g. ("property",)
    self_reads: tuple[str, ...] | None = None  # the only self attributes the body may read (None: unchecked)
    runnable: bool = False  # the module has an ``if __name__ == "__main__":`` block (``python -m``)
    statements: tuple[str, ...] = ()  # simple statements the body must hold, as ast.unparse writes them
    entries: tuple[tuple[str, str], ...] = ()  # dict-literal items the body must hold: (string key, value source)
    literals: tuple[str, ...] = ()  # string constants the body must hold (e.g. the names an allow-list tuple holds)
    blocks: str | None = None  # a capability this upstream fact keeps a table row from granting

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module
