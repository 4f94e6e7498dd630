"""``afd-mrv2 run`` end to end: real processes, gloo on loopback (2A2F also on zmq and tcp pairs), checked
against the reference.

Acceptance: max |diff| <= 1e-5 for both modes, for 2A1F and 2A2F, 4 layers, with
skewed routing and with an FFN rank that receives zero tokens; the trace shows
recv, compute and send of different work items overlapping on distinct streams
of an FFN rank; the same command runs under torchrun.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.mrv2.conftest import PROCESS_TRANSPORTS
from tests.procs import Proc, afd, child_env, running

# A smaller model than the default keeps each run to a few seconds on 2 shared cores.
SMALL = ["--hidden", "64", "--expert-size", "128", "--layers", "4", "--batches", "2", "--warmup", "1"]


def run_report(out: Path, *args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """``afd-mrv2 run --json`` (the SMALL model, then ``args``): its report and its stderr."""
    proc = afd("run", "--json", "--out", str(out), *SMALL, *args, env=env)
    with running(proc, out_dir=out):
        code = proc.wait(timeout_s)
    assert code == 0, f"exit {code}\n{proc.stderr[-3000:]}"
    assert len(proc.out) == 1, "--json prints exactly one line on stdout"
    return json.loads(proc.out[0]), proc.stderr


def run_json(out: Path, *args: str, timeout_s: float = 120.0) -> dict:
    return run_report(out, *args, timeout_s=timeout_s)[0]


def check_buffers(report: dict) -> None:
    """Each mode's buffer bytes are its counts x one buffer's bytes, computed apart from the
    measurement (SMALL: hidden 64; the default batch's per-stage capacity); JSON and table agree."""
    from afd_mrv2.hooks.p2p.wire import HEADER_BYTES
    from afd_mrv2.reference.buffer_report import buffers_cell
    from afd_mrv2.reference.report import render
    from afd_mrv2.reference.spec import BatchSpec

    hidden, capacity, attention = 64, BatchSpec().max_tokens, report["num_attention_ranks"]
    table = render(report, as_json=False).splitlines()
    for mode in report["modes"]:
        b = mode["buffers"]
        label = "serialized" if (b["in"], b["out"]) == (1, 1) else f"multistream {b['in']}in/{b['out']}out"
        assert mode["mode"] == label
        assert set(b["by_rank"]) == {f"attention {i}" for i in range(attention)} | {
            f"ffn {i}" for i in range(report["num_ffn_ranks"])
        }
        for rank in b["by_rank"].values():
            assert len(rank["input_bytes"]) == b["in"] and len(rank["output_bytes"]) == b["out"]
            assert rank["bytes"] == sum(rank["input_bytes"]) + sum(rank["output_bytes"]) > 0
        assert b["bytes"] == max(r["bytes"] for r in b["by_rank"].values()) == b["by_rank"][b["rank"]]["bytes"]
        # an attention rank's input buffer: [capacity, hidden] float32 it sums the FFN partials into
        assert b["by_rank"]["attention 0"]["input_bytes"] == [capacity * hidden * 4] * b["in"]
        # an FFN rank's output buffer: one combine message (header + capacity x hidden float32) per attention rank
        assert b["by_rank"]["ffn 0"]["output_bytes"] == [attention * (HEADER_BYTES + capacity * hidden * 4)] * b["out"]
        (line,) = [line for line in table if line.startswith(mode["mode"] + "  ")]
        assert buffers_cell(b) in line


def check_correct(report: dict, modes: tuple[str, ...] = ("serialized", "multistream 3in/3out")) -> None:
    assert report["layers"] == 4
    assert [m["mode"] for m in report["modes"]] == list(modes)
    check_buffers(report)
    for mode, diff in report["max_abs_diff_by_mode"].items():
        assert diff <= 1e-5, f"{mode}: max |diff| {diff}"
    assert report["max_abs_diff"] <= 1e-5 and report["ok"] is True
    for key in ("max_abs_diff", "speedup", "overlap_efficiency", "trace"):
        assert report[key] is not None
    assert Path(report["trace"]).is_file()
    assert Path(report["timeline"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def skewed_2a1f(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """2A1F, skewed routing, torch_p2p over gloo with a simulated 3 ms per transfer (the connector's own
    ``sim_latency_us``: the same transport, slower): one run for the routing test and the trace test."""
    args = ("--attention", "2", "--ffn", "1", "--routing", "skewed", "--link", "sim", "--sim-latency-us", "3000")
    return run_json(tmp_path_factory.mktemp("run"), *args)


def test_2a1f_skewed_routing_matches_the_reference(skewed_2a1f: dict) -> None:
    check_correct(skewed_2a1f)
    assert skewed_2a1f["topology"] == "2A1F"
    assert skewed_2a1f["routing_stats"]["hot_expert_share"] >= 0.7


@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
def test_2a2f_skewed_routing_matches_the_reference(tmp_path: Path, transport: str) -> None:
    report = run_json(
        tmp_path, "--attention", "2", "--ffn", "2", "--routing", "skewed", "--depths", "3", "--buffers", "3", "2",
        "--transport", transport,
    )  # fmt: skip
    assert report["transport"] == transport
    check_correct(report, ("serialized", "multistream 3in/3out", "multistream 3in/2out"))
    assert report["routing_stats"]["hot_expert_share"] >= 0.7
    assert all(t > 0 for t in report["routing_stats"]["tokens_per_ffn_rank"])


def test_2a2f_with_an_idle_ffn_rank_under_torchrun(tmp_path: Path) -> None:
    """The rank-per-process mode torchrun drives (also across machines); FFN rank 1 gets no token."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    command = ["--no-python", sys.executable, "-m", "afd_mrv2.cli", "run", "--json", "--out", str(tmp_path)]
    proc = Proc(
        [*torchrun, *command, *SMALL, "--attention", "2", "--ffn", "2", "--routing", "idle-rank"], env=child_env()
    )
    with running(proc):
        code = proc.wait(150)
    assert code == 0, proc.stderr[-3000:]
    report = json.loads([line for line in proc.out if line.startswith("{")][-1])
    check_correct(report)
    assert report["routing_stats"]["tokens_per_ffn_rank"][1] == 0
    for mode in report["modes"]:
        assert mode["tokens_per_ffn_rank"][1] == 0 and mode["tokens_per_ffn_rank"][0] > 0


def _overlapping_triple(spans: list[dict]) -> tuple[dict, dict, dict] | None:
    by_phase = {p: [s for s in spans if s["name"] == p] for p in ("recv", "compute", "send")}
    for c in by_phase["compute"]:
        c0, c1 = c["ts"], c["ts"] + c["dur"]
        for s in by_phase["send"]:
            if s["args"]["seq"] == c["args"]["seq"] or s["tid"] == c["tid"]:
                continue
            s0, s1 = max(c0, s["ts"]), min(c1, s["ts"] + s["dur"])
            if s0 >= s1:
                continue
            for r in by_phase["recv"]:
                seqs = {r["args"]["seq"], c["args"]["seq"], s["args"]["seq"]}
                if (
                    len(seqs) == 3
                    and r["tid"] not in (c["tid"], s["tid"])
                    and max(s0, r["ts"]) < min(s1, r["ts"] + r["dur"])
                ):
                    return r, c, s
    return None


def test_trace_shows_recv_compute_send_of_different_items_overlapping_on_an_ffn_rank(skewed_2a1f: dict) -> None:
    report = skewed_2a1f
    check_correct(report)
    assert report["topology"] == "2A1F" and report["link"] == {
        "kind": "sim",
        "sim_latency_us": 3000,
        "sim_bandwidth_gbps": 0.0,
    }
    trace = json.loads(Path(report["trace"]).read_text())
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"
    }
    lanes = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert len(lanes) == 3 * 1 + 3 * 3, (
        "one lane per stream per rank: 1 serial lane, then 3 multistream lanes, x 3 ranks"
    )
    ffn_pid = next(pid for pid, name in names.items() if "multistream" in name and "ffn 0" in name)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == ffn_pid]
    triple = _overlapping_triple(spans)
    assert triple is not None, "no moment where recv, compute and send of three different items overlap"
    serial_pid = next(pid for pid, name in names.items() if "serialized" in name and "ffn 0" in name)
    serial = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == serial_pid]
    assert _overlapping_triple(serial) is None, "the serialized mode runs one phase at a time"
    # how much sooner the multistream mode ends depends on the machine's load: a benchmark checks it
    # (tests/bench/test_bench_speedups.py, -m bench)


@pytest.mark.parametrize(("attention", "ffn"), [(3, 2), (2, 3)], ids=["3A2F", "2A3F"])
def test_free_topology_matches_the_reference(tmp_path: Path, attention: int, ffn: int) -> None:
    """F need not divide A, nor be <= A: experts are sharded over the FFN ranks and every
    FFN rank serves every attention rank (3A2F, 2A3F; 6 experts, 3 or 2 per FFN rank)."""
    report = run_json(
        tmp_path,
        *("--attention", str(attention), "--ffn", str(ffn), "--experts", "6"),
        *("--layers", "2", "--batches", "1", "--depths", "2"),
    )
    assert report["topology"] == f"{attention}A{ffn}F" and report["layers"] == 2
    assert [m["mode"] for m in report["modes"]] == ["serialized", "multistream 2in/2out"]
    check_buffers(report)
    for mode in report["modes"]:
        names = sorted(mode["max_abs_diff_by_rank"])
        assert [n.split(" (")[0] for n in names] == [f"attention rank {a}" for a in range(attention)], names
        assert max(mode["max_abs_diff_by_rank"].values()) <= 1e-5, mode["max_abs_diff_by_rank"]
        assert len(mode["tokens_per_ffn_rank"]) == ffn and all(t > 0 for t in mode["tokens_per_ffn_rank"])
    assert report["ok"] is True and report["max_abs_diff"] <= 1e-5


def test_bad_arguments_fail_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (``afd-mrv2 run``'s exit status as ``main`` returns it): nothing to start, nothing started."""
    from afd_mrv2.cli import main

    assert main(["run", "--attention", "3", "--ffn", "3", "--experts", "2", "--out", str(tmp_path)]) == 2
    assert "num_experts (2) must be at least the FFN ranks (3)" in capsys.readouterr().err
    assert not (tmp_path / "workers.json").exists()


# ------------------------------------------------------------------ --async-moe-split


def check_split(report: dict, policy: str) -> list[dict]:
    """Both modes within 1e-5 of the unsplit reference; every batch really ran as the planner's two stages."""
    assert [m["mode"] for m in report["modes"]] == ["serialized", "multistream 2in/2out"]
    for mode, diff in report["max_abs_diff_by_mode"].items():
        assert diff <= 1e-5, f"{mode}: max |diff| {diff}"
    assert report["ok"] is True and report["stages"] == 2 and report["async_moe_split"] == policy
    split = report["split"]
    assert split["policy"] == policy and split["batches"] == 2 * 3  # 2 attention ranks x (1 warm-up + 2 measured)
    for plan in split["plans"]:
        assert sum(plan["stage_tokens"]) == sum(plan["lengths"]) and min(plan["stage_tokens"]) > 0
    return split["plans"]


@pytest.mark.parametrize("policy", ["token", "request"])
def test_async_moe_split_matches_the_unsplit_reference(tmp_path: Path, policy: str) -> None:
    report = run_json(tmp_path, "--async-moe-split", policy, "--requests", "4", "--depths", "2")
    plans = check_split(report, policy)
    for plan in plans:
        if policy == "token":  # these shapes make the token split cut a request in every batch
            assert len(plan["continued"]) == 1 and plan["stage_tokens"][0] - plan["stage_tokens"][1] in (0, 1)
            (c,) = plan["continued"]
            assert 0 < c["context"] < c["seq_len"] == plan["lengths"][c["request"]]
        else:
            assert plan["continued"] == [] and plan["stage_requests"][0][1] + 1 == plan["stage_requests"][1][0]


def test_async_moe_token_split_of_one_long_prefill_mid_request(tmp_path: Path) -> None:
    """The upstream open question: ONE long prefill, cut in the middle, stage 2 a chunked prefill over stage 1."""
    report = run_json(
        tmp_path, "--async-moe-split", "token", "--requests", "1", "--min-len", "96", "--max-len", "96", "--depths", "2"
    )
    for plan in check_split(report, "token"):
        assert plan["stage_tokens"] == [48, 48] and plan["stage_requests"] == [[0, 0], [0, 0]]
        assert plan["continued"] == [{"request": 0, "context": 48, "query": 48, "seq_len": 96}]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attention-tp", "2"], "--attention-tp and --requests shape the async-MoE stages"),
        (["--async-moe-split", "token", "--requests", "4,0"], "each --requests count must be >= 1"),
        (["--async-moe-split", "token", "--ubatches", "2"], "give the batch size with --requests N"),
        (["--requests", "3"], "--requests only applies with --async-moe-split"),
    ],
)
def test_bad_split_combinations_are_refused_before_starting(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from afd_mrv2.cli import main

    assert main(["run", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "workers.json").exists()


def test_run_config_keeps_the_split_through_json() -> None:
    from afd_mrv2.reference.runconfig import RunConfig
    from afd_mrv2.reference.spec import BatchSpec

    cfg = RunConfig(async_moe_split="token", batch=BatchSpec(stages=1, requests_per_stage=3))
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg and again.num_stages == 2 and again.requests_per_batch == 3
    tp = RunConfig(async_moe_split="request", attention_tp=2, layout="sp", requests=(4, 1))
    assert RunConfig.from_json(tp.to_json()) == tp and tp.topology.num_attention == 4
    assert [tp.requests_for(a, b) for a in range(2) for b in range(2)] == [4, 1, 1, 4]
    pairs = RunConfig(depths=(2,), buffers=((3, 2),))
    assert RunConfig.from_json(pairs.to_json()) == pairs and pairs.modes == ((2, 2), (3, 2))
    with pytest.raises(ValueError, match="at least one"):
        RunConfig(depths=())
    with pytest.raises(ValueError, match=r"counts in 1\.\.8"):
        RunConfig(buffers=((0, 2),))
    with pytest.raises(ValueError, match="async_moe_split must be one of"):
        RunConfig(async_moe_split="tokens")
