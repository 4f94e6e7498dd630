"""``afd-mrv2 bench --link gloo``: the depth sweep on the real embedded deployment.

Runs the embedded AFD deployment (``afd-mrv2 run``: attention and FFN processes
over gloo on loopback, the reference model, the ``torch_p2p`` connector) once,
serialized and then at each (in, out) buffer count, and returns its per-mode rows
(each with the run's ``buffers`` block: counts and the bytes each rank held).  Phase times
are whatever the machine gives, so there is no per-cell model prediction here;
the simulated-link grid is where the model is checked.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from afd_mrv2.errors import AfdError
from afd_mrv2.reference.launcher import launch
from afd_mrv2.reference.runconfig import RunConfig


def run_gloo(
    buffers: tuple[tuple[int, int], ...], *, out_dir: str = "out/bench-gloo", batches: int = 3
) -> list[dict[str, Any]]:
    """One embedded run over the (in, out) buffer counts ``buffers``; rows: mode, counts, the
    buffers block (per FFN rank and the largest rank), per-layer ms, efficiency, hidden, speedup."""
    cfg = RunConfig(depths=(), buffers=buffers, link="gloo", batches=batches, out_dir=out_dir)
    with contextlib.redirect_stdout(io.StringIO()):  # launch prints its own report; we re-render
        status = launch(cfg, as_json=True)
    result_path = Path(out_dir).resolve() / "result.json"
    if status != 0 or not result_path.is_file():
        raise AfdError(
            f"the embedded gloo run failed (exit {status}); see the messages above and {out_dir}/workers.json"
        )
    result = json.loads(result_path.read_text())
    rows = []
    for mode in result["modes"]:
        rows.append(
            {
                "mode": "serialized" if not mode["pipelined"] else "pipelined",
                "depth": mode["depth"],
                "depth_in": mode["buffers"]["in"],
                "depth_out": mode["buffers"]["out"],
                "buffers": mode["buffers"],
                "per_layer_ms": mode["per_layer_ms"],
                "efficiency": mode["overlap_efficiency"],
                "hidden_comm_fraction": mode["hidden_comm_fraction"],
                "speedup": mode["speedup"],
                "cores_busy": mode["cpu_cores_busy"],
                "max_abs_diff": mode["max_abs_diff"],
            }
        )
    return rows
