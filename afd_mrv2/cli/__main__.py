"""``python -m afd_mrv2.cli``: the same as the ``afd-mrv2`` script (the launcher starts workers this way)."""

from __future__ import annotations

import sys

from afd_mrv2.cli import main

sys.exit(main())
