"""scripts/bench_serve.py without vLLM: pausing a server's whole process tree, the counters' windows,
the analytic limit and the report.

The three-sided run itself needs vLLM (docs/benchmarks-vllm.md holds a measured one); here a process
tree of plain Pythons stands in for a server (pause / resume / stop / labels), and synthetic
``afd_attention_stats`` snapshots and FFN reports for the counters.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from afd_mrv2.hooks.p2p.stamps import ATTENTION_POINTS, FFN_POINTS
from afd_mrv2.procs import stat_fields

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def load(name: str) -> ModuleType:
    """A script as a module (its sibling package serving importable while it loads)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


bench = load("bench_serve")
serving = sys.modules["serving"]

#: A root that starts a child in a session of its own (as serve starts its roles) which starts a grandchild.
TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    leaf = "import time; time.sleep(120)"
    mid = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {leaf!r}]); time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", mid], start_new_session=True)
    time.sleep(120)
    """
)


def _state(pid: int) -> str:
    fields = stat_fields(pid)
    return "gone" if fields is None else fields[0]


def test_pause_stops_every_process_of_the_tree_and_stop_ends_a_paused_one(tmp_path: Path) -> None:
    child = serving.Child([sys.executable, "-c", TREE], {}, tmp_path / "tree.log", stdout_pipe=False)
    try:
        deadline = time.monotonic() + 30
        while len(child.track()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = child.track()
        assert len(pids) == 3, pids  # root, the child in its own session, its child
        assert len({os.getpgid(p) for p in pids}) == 2  # a killpg of the root's group would miss two
        paused = child.pause()
        assert sorted(paused) == sorted(pids)
        assert {_state(p) for p in pids} == {"T"} and child.not_stopped() == []
        cpu = serving.process_cpu(pids)
        time.sleep(0.2)
        assert serving.process_cpu(pids) == cpu
        labels = child.processes()
        assert labels[child.proc.pid] == "APIServer" and len(labels) == 3
        child.resume()
        deadline = time.monotonic() + 5
        while "T" in {_state(p) for p in pids} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "T" not in {_state(p) for p in pids}
        child.pause()
        assert child.stop() is not None  # a paused server is resumed, then stopped
        assert child.leftovers() == []
    finally:
        child.stop()


def _stats(forwards: list[tuple[int, str, float]], overlap: dict[str, dict[str, float]], calls: int) -> dict[str, Any]:
    recent: dict[str, list[list[float]]] = {}
    steps: dict[str, dict[str, int]] = {"decode": {}}
    for index, n, ms in forwards:
        recent.setdefault(n, []).append([index, ms])
        steps["decode"][n] = steps["decode"].get(n, 0) + 1
    return {
        "calls": calls,
        "items_by_stage_count": {"1": calls},
        "overlap": overlap,
        "runner": {
            "num_ubatches": 2,
            "steps": steps,
            "failed_steps": 0,
            "forwards": len(forwards),
            "forward_ms_recent": recent,
        },
    }


def _overlap(steps: int, rts: int, rt_ms: float, hidden_ms: float, computes: int, compute_ms: float) -> dict[str, Any]:
    return {
        "steps": steps,
        "round_trips": rts,
        "round_trip_total_ms": rt_ms,
        "hidden_total_ms": hidden_ms,
        "computes": computes,
        "compute_total_ms": compute_ms,
    }


def test_window_cuts_forwards_by_index_and_differences_the_overlap_counters() -> None:
    side = bench.Side("ubatch", object.__new__(serving.ServeServer))
    early = [(0, "1", 90.0), (1, "1", 30.0)]
    before = {"steps_metric": [10], "stats": [_stats(early, {"1": _overlap(2, 4, 40, 0, 4, 8)}, 4)]}
    later = [*early, (2, "2", 20.0), (3, "1", 35.0), (4, "2", 22.0)]
    after_overlap = {"1": _overlap(3, 6, 61, 0, 6, 12), "2": _overlap(2, 8, 80, 20, 8, 12)}
    after = {"steps_metric": [13], "stats": [_stats(later, after_overlap, 14)]}
    got = bench.window(side, before, after)
    assert got["forward_ms"] == [20.0, 35.0, 22.0] and got["forward_stages"] == ["2", "1", "2"]
    assert got["steps"] == 3 == got["steps_metric"] and got["forwards_lost"] == 0
    assert got["overlap"]["1"] == _overlap(1, 2, 21, 0, 2, 4)
    assert got["overlap"]["2"] == _overlap(2, 8, 80, 20, 8, 12)
    assert got["calls"] == 10 and got["steps_by_kind"] == {"decode": {"1": 1, "2": 2}}
    means = bench.overlap_means(got["overlap"]["2"])
    assert (means["hidden_fraction"], means["round_trip_ms"], means["compute_ms"]) == (0.25, 10.0, 1.5)


#: one round trip's points (ns, one clock): pack 0.4, post 0.1, wire out 1.0, FFN wake-up 0.5, FFN compute 4.0,
#: FFN pack 0.2, wire back 1.8, Attention wake-up 0.7, unpack 0.3 us
A_POINTS = (1_000, 1_400, 1_500, 1_600, 9_000, 9_700, 10_000)
F_POINTS = (2_500, 3_000, 7_000, 7_200)


def _stamps(items: int, points: tuple[str, ...], values: tuple[int, ...]) -> dict[str, Any]:
    return {"items": items, "means_ns": dict(zip(points, values, strict=True))}


def _result() -> dict[str, Any]:
    def round_(side: str, tok_s: float, forwards: list[float], stages: list[str], overlap: dict[str, Any]) -> dict:
        return {
            "round": 1,
            "side": side,
            "wall_s": 2.0,
            "output_tokens": int(tok_s * 2),
            "tokens_per_s": tok_s,
            "cpu_s": 3.0,
            "cores_busy": 1.5,
            "processes_cpu_s": {"Worker": 2.5, "EngineCore": 0.5},
            "paused_pids": 12,
            "paused_cpu_s": 0.0,
            "steps": len(forwards) or 20,
            "steps_metric": len(forwards) or 20,
            "steps_by_kind": {"decode": {s: stages.count(s) for s in set(stages)}} if stages else None,
            "failed_steps": 0,
            "forward_ms": forwards,
            "forward_stages": stages,
            "forwards_lost": 0,
            "overlap": overlap,
        }

    plain = round_("plain", 100.0, [], [], {})
    del plain["forward_ms"], plain["forward_stages"], plain["steps_by_kind"], plain["failed_steps"]
    del plain["forwards_lost"], plain["overlap"]
    blocking = round_("blocking", 80.0, [20.0] * 4, ["1"] * 4, {"1": _overlap(4, 8, 80.0, 0, 8, 40.0)})
    # A = 5, round trip 10; ubatch: a = 3 per micro-batch, hidden 40 of 96 ms of round trips
    ubatch = round_("ubatch", 96.0, [16.0] * 4, ["2"] * 4, {"2": _overlap(4, 16, 96.0, 40.0, 16, 48.0)})
    rounds = [plain, blocking, ubatch]
    sides = {"plain": bench.Side("plain", object.__new__(serving.PlainServer))}
    sides.update({n: bench.Side(n, object.__new__(serving.ServeServer)) for n in ("blocking", "ubatch")})
    ffn = {
        "blocking": [{"rank": 0, "report": {"busy_s": 0.4, "computed": 100, "tokens_per_item": {"64": 100}}}],
        "ubatch": [{"rank": 0, "report": {"busy_s": 0.5, "computed": 200, "tokens_per_item": {"32": 200}}}],
    }
    # the last afd_attention_stats of each engine; the ubatch side's FFN rank served one item more (a re-send)
    final = {
        "blocking": [{"overlap": blocking["overlap"], "round_trip_stamps": _stamps(8, ATTENTION_POINTS, A_POINTS)}],
        "ubatch": [{"overlap": ubatch["overlap"], "round_trip_stamps": _stamps(16, ATTENTION_POINTS, A_POINTS)}],
    }
    ffn["blocking"][0]["report"]["round_trip_stamps"] = {"0": _stamps(8, FFN_POINTS, F_POINTS)}
    ffn["ubatch"][0]["report"]["round_trip_stamps"] = {"0": _stamps(17, FFN_POINTS, F_POINTS)}
    result: dict[str, Any] = {
        "ubatches": 2,
        "rounds": rounds,
        "ffn_reports": ffn,
        "running_s": {"plain": 10.0, "blocking": 10.0, "ubatch": 10.0},
        "serve_exit": {"blocking": 0, "ubatch": 0},
        "residual_pids": [],
        "load_average": {"start": (0.1, 0.2, 0.3), "end": (0.1, 0.2, 0.3)},
        "engine_core_ids": {"plain": {"plain": "[0, 1]"}},
        "cores": {
            "machine": 2,
            "plain": {"bind": "0,1", "count": 2},
            "ubatch": {"attention 0": {"bind": "0", "count": 1}, "ffn 0": {"bind": "1", "count": 1}},
        },
    }
    result["sides"] = {n: bench.side_summary(sides[n], rounds, 1) for n in bench.SIDES}
    result["round_trip"] = bench.round_trip_breakdown(final, ffn, 1)
    return result


def test_round_trip_breakdown_joins_each_engine_with_its_ffn_ranks_stamps() -> None:
    result = _result()
    blocking, ubatch = (result["round_trip"]["sides"][n][0] for n in ("blocking", "ubatch"))
    spans = blocking["spans_us"]
    assert (spans["wire out"], spans["FFN compute"], spans["wire back"]) == pytest.approx((1.0, 4.0, 1.8))
    assert spans["sum"] == pytest.approx(9.0) and blocking["measured_round_trip_us"] == pytest.approx(10_000.0)
    # counts differ: the joined spans are n/a, each side's own are kept
    assert ubatch["spans_us"]["wire out"] is None and ubatch["spans_us"]["FFN compute"] == pytest.approx(4.0)
    assert ubatch["measured_round_trip_us"] == pytest.approx(6_000.0)
    final = {"blocking": [{"overlap": {}, "round_trip_stamps": _stamps(8, ATTENTION_POINTS, A_POINTS)}]}
    two = bench.round_trip_breakdown(final, {"blocking": [{"rank": 0, "report": {}}] * 2}, 2)["sides"]["blocking"][0]
    assert two["ffn_stamps"] is None and two["spans_us"]["FFN compute"] is None  # 2 FFN ranks: not joined
    assert two["spans_us"]["pack"] == pytest.approx(0.4) and two["measured_round_trip_us"] is None


def test_analytic_limit_from_its_inputs() -> None:
    result = _result()
    got = bench.analytic(result, 2)
    # A = 40/8 = 5, F = 4 ms, a = 48/16 = 3, f = 2.5 ms, c = (80/8 - F) / 2 = 3
    assert (got["A_ms"], got["F_ms"], got["a_ms"], got["f_ms"]) == (5.0, 4.0, 3.0, 2.5)
    assert got["c_ms"] == pytest.approx(3.0)
    assert got["numerator_ms"] == pytest.approx(15.0)  # A + F + 2c = A + the blocking round trip
    assert got["terms_ms"] == pytest.approx({"N a": 6.0, "N f": 5.0, "a + f + 2c": 11.5})
    assert got["bound_by"] == "a + f + 2c" and got["analytic_limit"] == pytest.approx(15.0 / 11.5)
    assert got["measured_forward_speedup"] == pytest.approx(20.0 / 16.0)
    assert got["fraction_of_limit"] == pytest.approx(1.25 / (15.0 / 11.5))
    # the same computes with a faster transport: (A + F + 2c) / max(N a, N f, a + f + 2c) at 2c = 0 and 0.5 ms
    assert got["limit_free_transport"] == pytest.approx(9.0 / 6.0)
    assert got["limit_at_overhead_bar"] == pytest.approx(9.5 / 6.0)
    assert got["moe_layers"] is None and got["forward_bound"] is None  # the FFN reports name no moe_layers
    result["ffn_reports"]["ubatch"] = []
    assert bench.analytic(result, 2)["why_not"] == "no FFN 'done' report (computed items) from the ubatch side"


def test_a_forward_as_a_schedule_fills_and_drains_its_pipeline_once() -> None:
    """Blocking: layers * (a + f + 2c).  Two micro-batches of a = 1, f = 2, c = 0: the FFN is busy from t = 1
    on, so two layers end at 1 + 4 * 2 = 9 (blocking 2 * (2 + 4) = 12); a transfer of 0.5 delays the first
    item's arrival and the last combine (10), and a side that waits longer for its combines than it
    computes is bound by the round trip (a = 1, f = 0.1, c = 2: each layer waits a + f + 2c after the first)."""
    assert bench.schedule_forward_ms(1, 4, 2.0, 3.0, 0.5) == pytest.approx(4 * (2.0 + 3.0 + 1.0))
    assert bench.schedule_forward_ms(2, 2, 1.0, 2.0, 0.0) == pytest.approx(9.0)
    assert bench.schedule_forward_ms(2, 2, 1.0, 2.0, 0.5) == pytest.approx(10.0)
    assert bench.schedule_forward_ms(2, 2, 1.0, 0.1, 2.0) == pytest.approx(2 * (1.0 + 0.1 + 4.0) + 1.0)
    result = _result()
    for side in ("blocking", "ubatch"):
        result["ffn_reports"][side][0]["report"]["moe_layers"] = 2
    got = bench.analytic(result, 2)  # A = 5, F = 4, a = 3, f = 2.5, c = 3 (test_analytic_limit_from_its_inputs)
    blocking = 2 * (5.0 + 4.0 + 6.0)
    assert got["moe_layers"] == 2
    assert got["forward_bound"] == pytest.approx(blocking / bench.schedule_forward_ms(2, 2, 3.0, 2.5, 3.0))
    assert got["forward_bound_free_transport"] == pytest.approx(18.0 / bench.schedule_forward_ms(2, 2, 3.0, 2.5, 0.0))
    result["analytic"] = got
    result["ratios"] = {"ubatch/blocking tok_s": 1.2, "ubatch/blocking forward_ms": 0.8, "ubatch/plain tok_s": 0.96}
    text = bench.report(result)
    assert "a whole forward as a schedule (2 MoE layers, 2 micro-batches, filled and drained once):" in text


def test_report_prints_every_side_the_ratios_and_the_formula_inputs() -> None:
    result = _result()
    result["analytic"] = bench.analytic(result, 2)
    result["ratios"] = {"ubatch/blocking tok_s": 1.2, "ubatch/blocking forward_ms": 0.8, "ubatch/plain tok_s": 0.96}
    result["sides"]["ubatch"]["hidden_fraction"] = 40 / 96
    text = bench.report(result)
    assert "plain vLLM has no Attention runner counters: no forward time" in text
    assert "hidden 40.0 ms / round trips 96.0 ms = 0.417" in text
    for name in ("A = 5.000 ms", "F = 4.000 ms", "a = 3.000 ms", "f = 2.500 ms", "c = 3.000 ms"):
        assert name in text, name
    assert "= 1.304 (bound by a + f + 2c)" in text and "0.958 of the limit" in text
    assert "with a faster transport: 1.500 with a free one (2c = 0), 1.583 at 2c = 0.5 ms" in text
    assert "ubatch/plain: tok/s 0.960 (equal cores: plain pinned to 2, ubatch to 2)" in text
    assert "where a round trip goes (us, means over the whole run, 1A1F)" in text
    assert _cells(text, "wire out") == ["1.0", "n/a"] and _cells(text, "FFN compute") == ["4.0", "4.0"]
    assert _cells(text, "sum of the nine") == ["9.0", "n/a"]
    assert _cells(text, "measured round trip (overlap counters)") == ["10000.0", "6000.0"]
    assert _cells(text, "items (Attention / FFN)") == ["8", "/", "8", "16", "/", "17"]


def _cells(text: str, label: str) -> list[str]:
    """The cells of the table row ``label`` (a label is followed by two spaces at least)."""
    line = next(line for line in text.splitlines() if line.startswith(f"{label}  "))
    return line[len(label) :].split()


def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signals_restored: None
) -> None:
    """The script as a program once (its exit status and whole stderr), then every case through its ``main``."""
    (tmp_path / "config.json").write_text("{}")
    cases = (
        ([str(tmp_path / "none")], "is not a checkpoint folder"),
        ([str(tmp_path), "--ubatches", "1"], "--ubatches: expected an integer >= 2"),
        ([str(tmp_path), "--afd", "[1]"], "--afd: expected a JSON object, got list"),
        ([str(tmp_path), "--rounds", "0"], "--rounds: expected an integer >= 1"),
        ([str(tmp_path), "--engine-core-nice", "20"], "--engine-core-nice: expected an integer 1..19"),
    )
    args, says = cases[1]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_serve.py"), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, (args, done.stderr)
    for args, says in cases:
        code = bench.main(args)
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and err.count("\n") == 1 and says in err, (args, err)


#: A root whose child names itself as vLLM names its engine core (``VLLM::EngineCore``, cut to 15 characters).
ENGINE_TREE = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    core = (
        "import pathlib, threading, time; pathlib.Path('/proc/self/comm').write_text('VLLM::EngineCor'); "
        "threading.Thread(target=time.sleep, args=(120,), daemon=True).start(); time.sleep(120)"
    )
    subprocess.Popen([sys.executable, "-c", core])
    time.sleep(120)
    """
)


def _nice(pid: int) -> list[int]:
    """The nice value of every thread of ``pid`` (field 19 of its stat: /proc/TID is the thread's)."""
    tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    return [int(fields[16]) for tid in tids if (fields := stat_fields(tid)) is not None]


def test_engine_core_nice_renices_every_thread_of_the_engine_cores_only(tmp_path: Path) -> None:
    child = serving.Child([sys.executable, "-c", ENGINE_TREE], {}, tmp_path / "tree.log", stdout_pipe=False)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            cores = [p for p, label in child.processes().items() if "EngineCore" in label]
            if cores and len(list(Path(f"/proc/{cores[0]}/task").iterdir())) == 2:
                break
            time.sleep(0.05)
        assert bench.renice_engine_cores(child, 19) == cores and len(cores) == 1
        assert _nice(cores[0]) == [19, 19]  # both threads: the busy-poll may run on any of them
        assert set(_nice(child.proc.pid)) == {0}  # the front end keeps its priority
    finally:
        child.stop()
    plain = serving.Child(
        [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "p.log", stdout_pipe=False
    )
    try:
        with pytest.raises(serving.ServerError, match="no EngineCore process"):
            bench.renice_engine_cores(plain, 19)
    finally:
        plain.stop()
