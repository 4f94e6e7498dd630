"""Shared test set-up.

Hardware and runtime tests carry a marker (``npu``, ``gpu``, ``vllm_runtime``) and
are deselected by the default run (see ``addopts`` in pyproject.toml).  Requested
explicitly (``pytest -m gpu``), a test whose prerequisite is missing FAILS with the
reason: a missing prerequisite never turns into a silent pass or skip.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest


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
    return None


@pytest.fixture(autouse=True)
def _require_hardware(request: pytest.FixtureRequest) -> None:
    for marker in ("gpu", "npu", "vllm_runtime"):
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
