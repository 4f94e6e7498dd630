"""``afd_mrv2.ubatch``, the package's name before 0.3.0: it warns once and gives the same objects, submodules too."""

from __future__ import annotations

import importlib
import sys

import pytest

import afd_mrv2.stages
from afd_mrv2.stages import layout, metadata, pairing, planner


def test_the_old_package_and_its_submodules_are_the_new_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "afd_mrv2.ubatch" or m.startswith("afd_mrv2.ubatch.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.warns(DeprecationWarning, match=r"afd_mrv2.ubatch is deprecated since 0.3.0: import afd_mrv2.stages"):
        old = importlib.import_module("afd_mrv2.ubatch")
    assert [getattr(old, n) for n in afd_mrv2.stages.__all__] == [
        getattr(afd_mrv2.stages, n) for n in afd_mrv2.stages.__all__
    ]
    for module in (layout, metadata, pairing, planner):
        short = module.__name__.rsplit(".", 1)[1]
        assert importlib.import_module(f"afd_mrv2.ubatch.{short}") is module
    from afd_mrv2.ubatch.layout import decide_split  # the form docs and user code had

    assert decide_split is layout.decide_split
