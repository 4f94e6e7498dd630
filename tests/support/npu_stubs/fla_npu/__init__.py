"""Stand-in for ``fla_npu`` (Ascend's flash-linear-attention kernels, AscendC) on the CPU vehicle; see ../README.md.

``register_ascend_customop`` imports ``vllm_ascend.ops.gdn``, which imports
``fla_npu.ops.ascendc`` at module level.  Every submodule is a placeholder module and every
name an :class:`NpuOnly` that raises when called.
"""

from __future__ import annotations

from _npu_only import placeholder_getattr, placeholder_submodules

__getattr__ = placeholder_getattr("fla_npu")
placeholder_submodules("fla_npu")
