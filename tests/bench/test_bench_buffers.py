"""``afd-mrv2 bench``: buffer counts set apart, the bytes they held, and the model on (in, out)."""

from __future__ import annotations

import json

import pytest
import torch

from afd_mrv2.bench.grid import Scenario, run_grid
from afd_mrv2.bench.overlap import ROWS, WIDTH
from afd_mrv2.cli import main
from afd_mrv2.pipeline.schedule_model import SERIALIZED, PhaseTimes, predict_makespan
from afd_mrv2.reference.buffer_report import buffers_cell

SLOT = ROWS * WIDTH * torch.tensor([], dtype=torch.float32).element_size()  # one simlink buffer: float32 [ROWS, WIDTH]
TINY = Scenario("tiny", 1.0, 1.0, 1.0)


def test_grid_cells_carry_their_buffer_counts_bytes_and_a_model_on_those_counts() -> None:
    torch.set_num_threads(1)
    cells = run_grid(scenarios=(TINY,), depths=(2,), buffers=((3, 1),), items=8, repeats=1, auto_window=4)
    assert [(c.mode, c.depth_in, c.depth_out) for c in cells][:3] == [
        ("serialized", 1, 1),
        ("pipelined", 2, 2),
        ("pipelined", 3, 1),
    ]
    serialized = [PhaseTimes(*t) for t in cells[0].phase_ms]  # the model's only input
    for cell in cells:
        b = cell.buffers
        assert (b["in"], b["out"]) == (cell.depth_in, cell.depth_out)
        assert b["bytes"] == sum(b["input_bytes"]) + sum(b["output_bytes"])
        if cell.mode == "auto":  # the window ran with more buffers than it kept: those slots are still held
            assert all(n in (0, SLOT) for n in b["input_bytes"] + b["output_bytes"])
            continue
        assert b["input_bytes"] == [SLOT] * cell.depth_in and b["output_bytes"] == [SLOT] * cell.depth_out
        streams = SERIALIZED if cell.mode == "serialized" else None
        expected = predict_makespan(serialized, 8, cell.depth_in, depth_out=cell.depth_out, streams=streams)
        assert cell.predicted_ms == pytest.approx(expected)
    auto = cells[-1]
    expected = predict_makespan(serialized, 8, auto.depth_in, depth_out=auto.depth_out)
    assert auto.predicted_ms == pytest.approx(expected)


def test_bench_json_and_table_report_the_same_buffers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--scenario", "balanced", "--depths", "1", "--buffers", "2", "1", "--items", "4"]
    args += ["--repeats", "1", "--no-chart"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cells = result["cells"]
    assert [(c["mode"], c["depth_in"], c["depth_out"]) for c in cells[:3]] == [
        ("serialized", 1, 1),
        ("pipelined", 1, 1),
        ("pipelined", 2, 1),
    ]
    assert cells[2]["buffers"]["bytes"] == 3 * SLOT
    summary = result["summary"]["scenarios"]["balanced"]
    assert summary["best_buffers"] in ("1in/1out", "2in/1out") and "auto_buffers" in summary
    assert main(args) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("balanced ")]
    assert len(rows) == len(cells)
    for line, cell in zip(rows, cells, strict=True):
        assert buffers_cell(cell["buffers"]) in line, (line, cell["buffers"])
    assert "2+1 / 192 KiB" in rows[2]
    assert "buffers (in+out)" in table


def test_bench_refuses_a_buffer_count_out_of_range() -> None:
    with pytest.raises(SystemExit, match=r"count in 1\.\.8"):
        main(["bench", "--buffers", "9", "1", "--no-chart"])
