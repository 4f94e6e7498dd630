"""``afd-mrv2 run`` with attention TP (``--attention-tp 2``) in both layouts and the rank-consistent fallback.

Every run is checked against the single-process reference (max |diff| <= 1e-5)
and, through the FFN rank's received row count, that each TP rank handed the
CAM boundary only its shard: one FFN rank receives each physical row of every
stage exactly once per layer (a rank dispatching its whole stage would double
it).  The fallback runs are forced by ``--requests 4,4,1``: with two attention
DP ranks, batch 0 has 4 + 4 requests (split) and batches 1 and 2 have a rank
with a single request, which the request split cannot cut: every rank must run
them unsplit, or the stage counts on the wire disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import afd, child_env, running
from tests.reference.test_run_e2e import run_json, run_report

LAYERS = 2
FAST = ["--layers", str(LAYERS), "--batches", "2", "--warmup", "0", "--depths", "2"]


def physical_rows(report: dict) -> int:
    """Rows all attention DP ranks hand the CAM boundary per layer, from the reported stage layouts."""
    return sum(s["physical_tokens"] for p in report["split"]["plans"] for s in p["layouts"] if s["tp_rank"] == 0)


def check_shards(report: dict, tp: int) -> None:
    for plan in report["split"]["plans"]:
        for s in plan["layouts"]:
            assert s["physical_tokens"] % tp == 0 and s["tp_size"] == tp
            assert s["physical_tokens"] == s["real_tokens"] + s["dp_padding"] + s["tp_padding"] and s["tp_padding"] < tp
    for mode in report["modes"]:
        assert mode["tokens_per_ffn_rank"] == [LAYERS * physical_rows(report)], "each TP rank dispatches its shard only"
        assert max(mode["max_abs_diff_by_rank"].values()) <= 1e-5


#: The variables that turn the layout log on (AFD_MRV2_LAYOUT_LOG, and its old name).
LAYOUT_LOG_ENV = ("AFD_MRV2_LAYOUT_LOG", "AFD_ASYNC_MOE_LAYOUT_LOG")


@pytest.fixture(scope="module", params=["sp", "tp"])
def token_split_tp2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, str]:
    """One 95-token prefill cut mid-request at attention TP 2 in each layout, the layout log left at its
    default (off): (the layout, the run's report, its stderr), made once per layout for the tests that read it."""
    layout = request.param
    report, stderr = run_report(
        tmp_path_factory.mktemp(f"token-tp2-{layout}"),
        *("--async-moe-split", "token", "--attention", "1", "--attention-tp", "2", "--layout", layout),
        *("--requests", "1", "--min-len", "95", "--max-len", "95", *FAST),
        env={k: v for k, v in child_env().items() if k not in LAYOUT_LOG_ENV},
    )
    return layout, report, stderr


def test_token_split_mid_request_with_attention_tp2(token_split_tp2: tuple[str, dict, str]) -> None:
    """One 95-token prefill cut mid-request (48 + 47 tokens: odd, so the second stage needs TP padding)."""
    layout, report, _ = token_split_tp2
    assert report["attention_tp"] == 2 and report["layout"] == layout and report["num_attention_ranks"] == 2
    for plan in report["split"]["plans"]:
        assert plan["stage_tokens"] == [48, 47] and plan["continued"][0]["context"] == 48
        assert [(s["real_tokens"], s["tp_padding"]) for s in plan["layouts"]] == [(48, 0), (47, 1)]
    check_shards(report, 2)
    assert report["ok"] is True


@pytest.mark.parametrize("layout", ["sp", "tp"])
def test_request_split_with_fallback_dp_padding_and_attention_tp2(tmp_path: Path, layout: str) -> None:
    report = run_json(
        tmp_path,
        *("--async-moe-split", "request", "--attention", "2", "--attention-tp", "2", "--layout", layout),
        *("--requests", "4,4,1", *FAST[:2], "--batches", "3", "--warmup", "0", "--depths", "2"),
    )
    check_fallback(report, tp=2)
    check_shards(report, 2)


def check_fallback(report: dict, *, tp: int) -> None:
    by_batch: dict[int, list[dict]] = {}
    for plan in report["split"]["plans"]:
        by_batch.setdefault(plan["batch"], []).append(plan)
    assert sorted(by_batch) == [0, 1, 2] and all(len(p) == 2 * tp for p in by_batch.values())
    assert {p["stages"] for p in by_batch[0]} == {2}, "4 + 4 requests: every rank splits"
    for b in (1, 2):  # one DP rank has 1 request: every rank runs the step unsplit, the DP padding evens the rows
        assert {p["stages"] for p in by_batch[b]} == {1}, by_batch[b]
        assert all("no two-stage plan (1 request(s)" in p["unsplit"] for p in by_batch[b])
        rows = {s["real_tokens"] + s["dp_padding"] for p in by_batch[b] for s in p["layouts"]}
        assert len(rows) == 1 and any(s["dp_padding"] > 0 for p in by_batch[b] for s in p["layouts"])
    assert report["split"]["unsplit_batches"] == 2 * 2 * tp
    assert report["ok"] is True and report["max_abs_diff"] <= 1e-5


def test_fallback_without_tp_and_the_layout_log(tmp_path: Path) -> None:
    """TP 1: the fallback alone; AFD_MRV2_LAYOUT_LOG=1 prints one line per step and stage and rank."""
    proc = afd(
        "run", "--json", "--out", str(tmp_path), "--hidden", "64", "--expert-size", "128",
        *("--async-moe-split", "request", "--attention", "2", "--requests", "4,4,1"),
        *("--layers", "2", "--batches", "3", "--warmup", "0", "--depths", "2"),
        env=child_env(AFD_MRV2_LAYOUT_LOG="1"),
    )  # fmt: skip
    with running(proc, out_dir=tmp_path):
        assert proc.wait(120) == 0, proc.stderr[-3000:]
    report = json.loads(proc.out[0])
    check_fallback(report, tp=1)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("afd-mrv2 layout: ")]
    # 2 modes x 2 ranks x (batch 0: 2 stages, batches 1, 2: 1 stage)
    assert len(lines) == 2 * 2 * 4, lines
    assert any("step 0 stage 2/2 request split, tp layout x tp 1: real " in line for line in lines)
    assert any("step 2 stage 1/1 unsplit (" in line and "+ dp padding " in line for line in lines)


@pytest.mark.parametrize("token_split_tp2", ["sp"], indirect=True)  # the sp layout's run, made once above
def test_no_layout_log_by_default(token_split_tp2: tuple[str, dict, str]) -> None:
    _, report, stderr = token_split_tp2
    assert report["split"]["plans"] and "afd-mrv2 run: [1/2] serialized" in stderr  # a split run, its stderr read
    assert "afd-mrv2 layout:" not in stderr
