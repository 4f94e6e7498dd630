"""Stand-in for ``torch_npu`` (Ascend's PyTorch backend) on the CPU vehicle; see ../README.md.

The real package loads CANN (``libhccl.so``) on import and fails without it.  Like the real one,
importing this renames torch's PrivateUse1 backend to ``npu`` and registers the device module
``torch.npu`` (torch's own ``rename_privateuse1_backend`` / ``_register_device_module``); unlike
it, every submodule without a file here is a placeholder module,
``torch.distributed.is_hccl_available()`` is False, and every other attribute is an :class:`NpuOnly` placeholder that raises when called.
vllm-ascend imports it at module level in ~100 modules (``vllm_ascend/utils.py`` first).
"""

from __future__ import annotations

import contextlib

import torch
from _npu_only import placeholder_getattr, placeholder_submodules

from torch_npu import npu

__version__ = "2.10.0.post4+vehicle-stub"

with contextlib.suppress(RuntimeError):  # already renamed in this process
    torch.utils.rename_privateuse1_backend("npu")
if not hasattr(torch, "npu"):
    torch._register_device_module("npu", npu)
# the real torch_npu adds this to torch.distributed on import (HCCL is its collective backend);
# vllm-ascend imports it by name (model_loader/netloader/executor/netloader_pg.py)
if not hasattr(torch.distributed, "is_hccl_available"):
    torch.distributed.is_hccl_available = lambda: False

# the real torch_npu adds Tensor.npu() (a copy onto the NPU); the vehicle's only device is the CPU, so here it
# returns the tensor where it is (vllm-ascend's AscendRoutedExperts.init_eplb calls it on a load counter)
if not hasattr(torch.Tensor, "npu"):
    torch.Tensor.npu = lambda self, *args, **kwargs: self  # type: ignore[attr-defined]

__getattr__ = placeholder_getattr("torch_npu")
# compiled bindings and op plugins (torch_npu._C._distributed_c10d, torch_npu.op_plugin.atb._atb_ops,
# torch_npu.profiler, ...): each a placeholder module unless a file here stands in for it
placeholder_submodules("torch_npu")
