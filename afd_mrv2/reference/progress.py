"""One progress line of ``afd-mrv2 run`` on stderr, shared by the launcher and its workers (no torch here)."""

from __future__ import annotations

import os
import sys


def progress(message: str) -> None:
    """A progress line on stderr (stdout stays machine-readable).

    One ``os.write`` per message: workers share the launcher's stderr, and
    ``print`` writes the text and the newline separately, so lines of two
    processes failing at the same moment would interleave.
    """
    sys.stderr.flush()
    os.write(2, f"afd-mrv2 run: {message}\n".encode("utf-8", "replace"))
