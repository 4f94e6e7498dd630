"""Old module paths users type (``--worker-cls``, ``--worker-extension-cls``, ``python -m``), kept one more
version: each warns once with a :class:`DeprecationWarning` naming the new path."""

from __future__ import annotations

import warnings


def warn_moved(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new} (moved in afd-mrv2 0.3.0)", DeprecationWarning, stacklevel=3)
