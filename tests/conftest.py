"""Shared test set-up.

Hardware and runtime tests carry a marker (``npu``, ``gpu``, ``vllm_runtime``) and
are deselected by the default run (see ``addopts`` in pyproject.toml).  Requested
explicitly (``pytest -m gpu``), a test whose prerequisite is missing FAILS with the
reason: a missing prerequisite never turns into a silent pass or skip.

A test whose kernels need a CPU feature carries that feature's marker (:data:`CPU_FEATURES`: ``amx``).
Where the host lacks the feature such tests are deselected, and the run says so in one line
(``no amx_tile on this host: 5 tests marked amx not run``); requested explicitly (the ``-m``
expression needs the marker, or the test is named by its node id) they FAIL with the reason.
``$AFD_MRV2_TEST_CPU_FLAGS`` (the test suite's, not the product's) stands for the host's flags:
``amx_tile avx512f`` replaces them, ``-amx_tile`` / ``+amx_tile`` take one away or add one.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from afd_mrv2.procs import cpu_flags

#: marker -> the ``/proc/cpuinfo`` flags its tests' kernels need (docs/vllm.md, "Which schemes need which CPU feature")
CPU_FEATURES: dict[str, tuple[str, ...]] = {"amx": ("amx_tile",)}
#: the test suite's stand-in for the host's CPU flags (see the module docstring)
CPU_FLAGS_ENV = "AFD_MRV2_TEST_CPU_FLAGS"


def host_cpu_flags() -> frozenset[str]:
    """The host's CPU flags as the tests take them: ``/proc/cpuinfo``'s, or as ``$AFD_MRV2_TEST_CPU_FLAGS`` says."""
    words = os.environ.get(CPU_FLAGS_ENV, "").replace(",", " ").split()
    plain = {w for w in words if w[0] not in "+-"}
    flags = set(plain) if plain else set(cpu_flags() or ())
    flags |= {w[1:] for w in words if w[0] == "+"}
    flags -= {w[1:] for w in words if w[0] == "-"}
    return frozenset(flags)


def _missing_cpu_features(marker: str) -> str | None:
    absent = [flag for flag in CPU_FEATURES[marker] if flag not in host_cpu_flags()]
    if not absent:
        return None
    source = f"${CPU_FLAGS_ENV}" if os.environ.get(CPU_FLAGS_ENV) else "/proc/cpuinfo"
    return f"no {', '.join(absent)} on this host ({source})"


def _explicitly_requested(item: pytest.Item, marker: str, config: pytest.Config) -> bool:
    """Whether the run asked for ``item`` itself: named by node id, or selected by an ``-m`` expression that
    would not select it without ``marker``."""
    for arg in config.args:
        path, sep, name = arg.partition("::")
        if sep and Path(path).resolve() == item.path.resolve() and item.nodeid.partition("::")[2].startswith(name):
            return True
    markexpr = config.option.markexpr
    if not markexpr:
        return False
    names = {m.name for m in item.iter_markers()}
    expression = Expression.compile(markexpr)
    return expression.evaluate(lambda name, **_: name in names) and not expression.evaluate(
        lambda name, **_: name in names - {marker}
    )


@pytest.hookimpl(trylast=True)  # after ``-m`` deselected what it does not select
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests of a CPU feature this host lacks (unless requested explicitly; they fail then)."""
    left_out: dict[str, list[pytest.Item]] = {}
    for item in items:
        for marker in CPU_FEATURES:
            if item.get_closest_marker(marker) is None or _explicitly_requested(item, marker, config):
                continue
            reason = _missing_cpu_features(marker)
            if reason is not None:
                left_out.setdefault(f"{reason}: {{n}} marked {marker} not run", []).append(item)
                break
    gone = {id(i) for out in left_out.values() for i in out}
    if gone:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in gone])
        items[:] = [i for i in items if id(i) not in gone]
    config.stash[_LEFT_OUT] = [
        line.format(n=f"{len(out)} test{'s' if len(out) > 1 else ''}") for line, out in left_out.items()
    ]


_LEFT_OUT = pytest.StashKey[list[str]]()


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    return config.stash.get(_LEFT_OUT, [])


def _missing(marker: str) -> str | None:
    if marker == "gpu":
        import torch

        return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
    if marker == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
        import torch
        import torch_npu  # noqa: F401 - importing it registers the torch.npu device module

        return None if torch.npu.is_available() else "no Ascend NPU (torch.npu.is_available() is False)"
    if marker == "vllm_runtime":
        return None if importlib.util.find_spec("vllm") is not None else "vllm is not importable"
    if marker in CPU_FEATURES:
        return _missing_cpu_features(marker)
    return None


@pytest.fixture(autouse=True)
def _require_hardware(request: pytest.FixtureRequest) -> None:
    for marker in ("gpu", "npu", "vllm_runtime", *CPU_FEATURES):
        if request.node.get_closest_marker(marker) is not None:
            reason = _missing(marker)
            if reason is not None:
                pytest.fail(f"test marked {marker!r} was selected but its prerequisite is missing: {reason}")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test (ranks run as threads of one process; timings stay steady)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
