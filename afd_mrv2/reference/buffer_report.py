"""The ``buffers`` block every ``run``, ``demo`` and ``bench`` result carries.

See docs/internals/reference.md, "afd_mrv2.reference.buffer_report".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from afd_mrv2.pipeline.executor import Executor


def buffer_block(executor: Executor) -> dict[str, Any]:
    """The ``buffers`` block of ``executor`` as it stands now (call after drain, before close)."""
    measured = executor.buffer_bytes()
    return {
        "in": executor.depth_in,
        "out": executor.depth_out,
        "bytes": measured.total,
        "input_bytes": list(measured.inputs),
        "output_bytes": list(measured.outputs),
    }


def counts_label(depth_in: int, depth_out: int) -> str:
    """How a mode label names its buffer counts: ``2in/2out``."""
    return f"{depth_in}in/{depth_out}out"


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``96 B``, ``64 KiB``, ``1.3 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            if unit == "B":
                return f"{n} B"
            return f"{value:.0f} {unit}" if value >= 100 or value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def buffers_cell(block: Mapping[str, Any]) -> str:
    """The table cell of a ``buffers`` block: ``2+2 / 128 KiB``.

    When more slots hold buffers than the counts in use (``depth: "auto"`` after
    its window), the slots held are named too: ``2+1 (6+6 held) / 768 KiB``.
    """
    held_in = sum(1 for b in block["input_bytes"] if b)
    held_out = sum(1 for b in block["output_bytes"] if b)
    counts = f"{block['in']}+{block['out']}"
    if held_in > block["in"] or held_out > block["out"]:
        counts += f" ({held_in}+{held_out} held)"
    return f"{counts} / {format_bytes(block['bytes'])}"
