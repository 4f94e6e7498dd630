"""Plain-text tables for command output."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned first column, right-aligned others; floats with 3 decimals."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1e4 else f"{value:.3g}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=False))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in text)])
