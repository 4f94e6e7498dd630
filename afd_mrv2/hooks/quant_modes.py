"""The wire quantisation modes a connector may apply (torch-free, so that command lines can offer them)."""

from __future__ import annotations

#: ``w8a8``: hidden rows travel as int8 with one fp32 scale per token (:mod:`afd_mrv2.hooks.quant`).
QUANT_MODES = ("w8a8",)
