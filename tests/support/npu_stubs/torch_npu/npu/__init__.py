"""Stand-in for ``torch_npu.npu``, registered as ``torch.npu``; see ../../README.md.

No device: ``is_available()`` is False and ``device_count()`` 0.  ``Stream`` / ``Event``
subclass ``torch.Stream`` / ``torch.Event`` as the real ones do (vllm-ascend names them in
annotations, e.g. ``torch.npu.Event | None`` in ``lora/quant_moe.py``); constructing one raises.
Every other name is an :class:`NpuOnly` placeholder that raises when called.
"""

from __future__ import annotations

from typing import Any

import torch
from _npu_only import placeholder_getattr


class Stream(torch.Stream):
    def __new__(cls, *args: Any, **kwargs: Any) -> Stream:
        raise NotImplementedError("NPU-only: torch.npu.Stream was constructed on the CPU vehicle")


class Event(torch.Event):
    def __new__(cls, *args: Any, **kwargs: Any) -> Event:
        raise NotImplementedError("NPU-only: torch.npu.Event was constructed on the CPU vehicle")


def is_available() -> bool:
    return False


def device_count() -> int:
    return 0


__getattr__ = placeholder_getattr("torch_npu.npu")
