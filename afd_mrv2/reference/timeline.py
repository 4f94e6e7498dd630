"""The timeline picture of ``afd-mrv2 run``: one panel per mode, one lane per stream per rank.

Phases are coloured (recv blue, compute orange, send green) and the panels share
the time axis, so the serialized and the multistream runs compare at a glance.
matplotlib is optional (``test`` and ``plot`` extras); without it
:func:`draw_timeline` raises ImportError and the run reports how to install it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"recv": "#4C78A8", "compute": "#F58518", "send": "#54A24B"}
_STREAM_ORDER = {"recv": 0, "serial": 1, "compute": 1, "send": 2}


def draw_timeline(path: str | Path, ranks: list[dict[str, Any]], report: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    modes = report["modes"]
    ordered = sorted(ranks, key=lambda r: r["rank"])
    lanes_per_mode = []
    for i in range(len(modes)):
        lanes: dict[tuple[int, str], list[tuple[float, float, str]]] = {}
        start = min((s[7] for r in ordered for s in r["modes"][i]["spans"]), default=0)
        for r in ordered:
            for name, stream, _sid, *_rest, t0, t1 in r["modes"][i]["spans"]:
                key = (r["rank"], stream)
                lanes.setdefault(key, []).append(((t0 - start) / 1e6, (t1 - t0) / 1e6, name))
        lanes_per_mode.append(lanes)
    heights = [max(len(lanes), 1) for lanes in lanes_per_mode]
    fig, axes = plt.subplots(
        len(modes), 1, figsize=(12, 1.2 + 0.28 * sum(heights)), sharex=True, gridspec_kw={"height_ratios": heights}
    )
    axes = list(axes) if len(modes) > 1 else [axes]
    names = {r["rank"]: f"{'A' if r['role'] == 'attention' else 'F'}{r['index']}" for r in ordered}
    for ax, mode, lanes in zip(axes, modes, lanes_per_mode, strict=True):
        keys = sorted(lanes, key=lambda k: (k[0], _STREAM_ORDER.get(k[1], 3)))
        for row, key in enumerate(keys):
            for phase in COLOURS:
                bars = [(x, w) for x, w, name in lanes[key] if name == phase]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLOURS[phase], edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(keys)), [f"{names[rank]} {stream}" for rank, stream in keys], fontsize=7)
        ax.set_ylim(len(keys) - 0.5, -0.5)
        ax.set_title(
            f"{mode['mode']}: {mode['per_layer_ms']:.2f} ms/layer, speedup {mode['speedup']:.2f}x, "
            f"overlap efficiency {mode['overlap_efficiency'] or 0:.2f}",
            fontsize=9,
            loc="left",
        )
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms since the first measured phase of the mode")
    fig.legend(handles=[Patch(color=c, label=p) for p, c in COLOURS.items()], loc="upper right", ncol=3, fontsize=8)
    fig.suptitle(
        f"afd-mrv2 run: {report['topology']}, {report['layers']} layers, {report['stages']} micro-batches, "
        f"routing {report['routing']}, link {report['link']['kind']}",
        fontsize=10,
        x=0.01,
        ha="left",
    )
    fig.tight_layout()
    target = Path(path)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
