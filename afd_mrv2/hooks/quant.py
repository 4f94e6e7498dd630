"""W8A8-style dynamic quantization of the activations a connector dispatches.

Per-token symmetric int8 with one float32 scale per row; the FFN compute dequantizes.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.quant".
"""

from __future__ import annotations

import torch

W8A8 = "w8a8"
INT8_MAX = 127


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] -> (int8 rows [T, H], float32 scales [T]); see docs/internals/p2p-transport.md."""
    amax = x.abs().amax(dim=1).to(torch.float32) if x.shape[0] else x.new_zeros((0,), dtype=torch.float32)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x.to(torch.float32) / scales.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_per_token(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [T, H] times their scales [T]: the activations compute works on."""
    if q.dtype != torch.int8:
        raise TypeError(f"dequantize_per_token: expected int8 rows, got {q.dtype}")
    if scales.shape != (q.shape[0],):
        raise ValueError(f"dequantize_per_token: expected {q.shape[0]} scales (one per row), got {tuple(scales.shape)}")
    return (q.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)).to(dtype)


def error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-row bound on the per-element quantization error of ``x``: half a step, ``max|x_t| / 254``."""
    return x.abs().amax(dim=1).to(torch.float32) / (2 * INT8_MAX)
