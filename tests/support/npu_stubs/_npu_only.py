"""The placeholder every NPU-only stand-in hands out (see README.md beside this file).

Accessing an attribute of a stub gives an :class:`NpuOnly`; calling it raises
``NotImplementedError`` naming what was called, so the CPU vehicle stops loudly at the first
place real vllm-ascend code would run an NPU operator.  Attribute access on a placeholder
gives another placeholder (``torch_npu._C._npu_foo``), so module-level decorators and
aliases import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class NpuOnly:
    """An NPU-only object: importable, never callable on CPU."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> NpuOnly:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return NpuOnly(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"NPU-only: {self._name} was called on the CPU vehicle (a stub stands in for it)")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        """``class X(torch.npu.NPUGraph)``: the base is a class whose construction raises."""
        return (npu_only_class(self._name),)

    def __or__(self, other: object) -> NpuOnly:  # ``torch_npu.X | None`` in an annotation
        return self

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<NpuOnly {self._name}>"


def npu_only_class(name: str) -> type:
    """A class standing in for the NPU-only class ``name``: subclassable, never constructed on CPU."""

    def __init__(self: object, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"NPU-only: {name} (a base class) was constructed on the CPU vehicle")

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": name.rsplit(".", 1)[0]})


def placeholder_getattr(module: str) -> Any:
    """A module ``__getattr__`` that answers every missing name with an :class:`NpuOnly`."""

    def __getattr__(name: str) -> NpuOnly:
        if name.startswith("__"):
            raise AttributeError(name)
        return NpuOnly(f"{module}.{name}")

    return __getattr__


class _PlaceholderModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every submodule of ``prefix`` that has no file of its own as a placeholder module."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix + "."

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self._prefix):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__getattr__ = placeholder_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def placeholder_submodules(prefix: str) -> None:
    """Make ``prefix.<anything>`` importable as a placeholder module (appended: real files win)."""
    if not any(isinstance(f, _PlaceholderModules) and f._prefix == prefix + "." for f in sys.meta_path):
        sys.meta_path.append(_PlaceholderModules(prefix))
