"""Deprecated path of :mod:`afd_mrv2.mrv2.ffn.role`: ``python -m afd_mrv2.mrv2.ffn_role`` still starts an FFN
role, after a :class:`DeprecationWarning` naming ``python -m afd_mrv2.mrv2.ffn.role``."""

from __future__ import annotations

import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    warnings.warn(
        "python -m afd_mrv2.mrv2.ffn_role is deprecated; use python -m afd_mrv2.mrv2.ffn.role (moved in afd-mrv2 0.3.0)",
        DeprecationWarning,
        stacklevel=2,
    )
    from afd_mrv2.mrv2.ffn.role import main as role_main

    return role_main(argv)


if __name__ == "__main__":
    sys.exit(main())
