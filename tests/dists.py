"""One writer of a distribution's metadata, as pip lays it out: how the tests install third-party plugins."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def write_dist_info(site: Path, name: str, version: str, entry_points: Mapping[str, Mapping[str, str]]) -> Path:
    """``<name>-<version>.dist-info`` in ``site`` with METADATA and ``entry_points.txt`` (group -> {name: target})."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    groups = [
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) for group, points in entry_points.items()
    ]
    (info / "entry_points.txt").write_text("\n".join(groups))
    return info
