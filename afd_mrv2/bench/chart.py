"""PNG chart of a bench grid: speedup vs buffer counts per scenario, bound and model drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from afd_mrv2.bench.grid import Cell
from afd_mrv2.errors import AfdError


def _pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise AfdError("charts need matplotlib: pip install -e '.[plot]' (or skip the chart with --no-chart)") from exc
    return plt


def write_chart(cells: Sequence[Cell], path: str | Path) -> Path:
    """One panel per scenario: measured speedup per (in, out) buffer counts, the model, auto, the bound."""
    plt = _pyplot()
    scenarios = list(dict.fromkeys(c.scenario for c in cells))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4 * len(scenarios), 3.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], scenarios, strict=True):
        rows = [c for c in cells if c.scenario == name]
        serial = next(c for c in rows if c.mode == "serialized")
        piped = sorted((c for c in rows if c.mode == "pipelined"), key=lambda c: (c.depth, c.depth_in, c.depth_out))
        xs = list(range(len(piped)))
        ax.plot(xs, [c.speedup for c in piped], "o-", label="measured")
        ax.plot(xs, [serial.makespan_ms / c.predicted_ms for c in piped], "x--", label="model")
        bound = serial.makespan_ms / min(c.lower_bound_ms for c in piped)
        ax.axhline(bound, color="grey", linestyle=":", label=f"bound {bound:.2f}x")
        pairs = [(c.depth_in, c.depth_out) for c in piped]
        for auto in (c for c in rows if c.mode == "auto"):
            pair = (auto.depth_in, auto.depth_out)
            x = pairs.index(pair) if pair in pairs else len(piped) - 0.5
            ax.plot([x], [auto.speedup], "s", color="tab:red", label=f"auto ({auto.label})")
        ax.set_title(name)
        ax.set_xlabel("buffers (in/out)")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{i}/{o}" for i, o in pairs])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over serialized")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
