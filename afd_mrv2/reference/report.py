"""What ``afd-mrv2 run`` reports: the summary, the merged Chrome trace, the table.

See docs/internals/reference.md, "afd_mrv2.reference.report".
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from afd_mrv2.devices.base import Span
from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline.trace import Trace, write_chrome_trace
from afd_mrv2.reference.buffer_report import buffers_cell, format_bytes
from afd_mrv2.reference.quant_check import summarize
from afd_mrv2.reference.runconfig import RunConfig
from afd_mrv2.table import format_table
from afd_mrv2.topology import ATTENTION


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def build_report(cfg: RunConfig, ranks: list[dict[str, Any]], *, sim_latency_us: float | None) -> dict[str, Any]:
    """Summarise the per-rank results gathered on rank 0."""
    spec = cfg.routed_model
    attention = [r for r in ranks if r["role"] == ATTENTION]
    modes = _mode_rows(cfg, ranks)
    headline = modes[1] if len(modes) > 1 else modes[0]
    max_diff = max(m["max_abs_diff"] for m in modes)
    quant = summarize(cfg.quant, [m for r in attention for m in r["modes"]]) if cfg.quant else None
    tolerance = cfg.tolerance if quant is None else quant["max_bound"]
    ok = max_diff <= tolerance if quant is None else quant["worst_ratio"] <= 1.0
    return {
        "topology": f"{cfg.num_attention}A{cfg.num_ffn}F",
        "num_attention_ranks": cfg.attention_processes,
        "attention_dp": cfg.num_attention,
        "attention_tp": cfg.attention_tp,
        "layout": cfg.layout if cfg.async_moe_split else None,
        "num_ffn_ranks": cfg.num_ffn,
        "layers": spec.num_layers,
        "stages": cfg.num_stages,
        "requests_per_stage": cfg.batch.requests_per_stage,
        "requests_per_batch": cfg.requests_per_batch,
        "async_moe_split": cfg.async_moe_split,
        "split": _split_summary(cfg, attention),
        "batches": cfg.batches,
        "warmup_batches": cfg.warmup,
        "routing": cfg.routing,
        "link": {"kind": cfg.link, "sim_latency_us": sim_latency_us, "sim_bandwidth_gbps": cfg.sim_bandwidth_gbps}
        if cfg.link == "sim"
        else {"kind": "gloo"},
        "transport": cfg.transport,
        "model": {k: v for k, v in asdict(spec).items() if k not in ("rms_eps",)},
        "modes": modes,
        "speedup": headline["speedup"],
        "overlap_efficiency": headline["overlap_efficiency"],
        "hidden_comm_fraction": headline["hidden_comm_fraction"],
        "max_abs_diff": max_diff,
        "max_abs_diff_by_mode": {m["mode"]: m["max_abs_diff"] for m in modes},
        "tolerance": tolerance,
        "ok": ok,
        "quant": quant,
        "routing_stats": _routing_stats(cfg, attention, modes[0]["tokens_per_ffn_rank"]),
        "trace": None,
        "timeline": None,
    }


def _mode_rows(cfg: RunConfig, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mode (serialized first): time per layer, cores busy, overlap, diffs, buffers, speedup."""
    layer_runs = cfg.batches * cfg.routed_model.num_layers
    attention = [r for r in ranks if r["role"] == ATTENTION]
    ffn = [r for r in ranks if r["role"] != ATTENTION]
    modes = []
    for i, head in enumerate(ranks[0]["modes"]):
        modes.append(
            {
                "mode": head["label"],
                "pipelined": head["pipelined"],
                "depth": head["depth"],
                "per_layer_ms": head["wall_s"] * 1e3 / layer_runs,
                "wall_ms": head["wall_s"] * 1e3,
                "cpu_cores_busy": sum(r["modes"][i]["cpu_s"] for r in ranks) / head["wall_s"],
                "machine_load_average": head["load_average"],
                "cpu_ms_per_layer_by_rank": {r["name"]: r["modes"][i]["cpu_s"] * 1e3 / layer_runs for r in ranks},
                "overlap_efficiency": _mean([r["modes"][i]["metrics"]["efficiency"] for r in ffn]),
                "hidden_comm_fraction": _mean([r["modes"][i]["metrics"]["hidden_comm_fraction"] for r in ffn]),
                "attention_overlap_efficiency": _mean([r["modes"][i]["metrics"]["efficiency"] for r in attention]),
                "max_abs_diff": max(r["modes"][i]["max_abs_diff"] for r in attention),
                "max_abs_diff_by_rank": {r["name"]: r["modes"][i]["max_abs_diff"] for r in attention},
                "tokens_per_ffn_rank": [r["modes"][i]["ffn_tokens"] for r in ffn],
                "buffers": _buffers(ranks, i),
            }
        )
    for mode in modes:
        mode["speedup"] = modes[0]["per_layer_ms"] / mode["per_layer_ms"]
    return modes


def _routing_stats(cfg: RunConfig, attention: list[dict[str, Any]], tokens_per_ffn_rank: list[int]) -> dict[str, Any]:
    """How the first mode's tokens were routed: per layer, each expert's share, the hottest expert."""
    spec = cfg.routed_model
    expert_tokens = [sum(r["modes"][0]["expert_tokens"][e] for r in attention) for e in range(spec.num_experts)]
    routed = sum(r["modes"][0]["routed_tokens"] for r in attention) or 1
    hot = max(range(spec.num_experts), key=lambda e: expert_tokens[e])
    return {
        "tokens_per_layer": routed // spec.num_layers,
        "expert_share": [t / routed for t in expert_tokens],
        "hot_expert": hot,
        "hot_expert_share": expert_tokens[hot] / routed,
        "tokens_per_ffn_rank": tokens_per_ffn_rank,
    }


def _buffers(ranks: list[dict[str, Any]], i: int) -> dict[str, Any]:
    """Mode ``i``'s buffers block: the counts, the largest rank's bytes, and every rank's."""
    by_rank = {
        f"{r['role']} {r['index']}": {
            "role": r["role"],
            "bytes": r["modes"][i]["buffers"]["bytes"],
            "input_bytes": r["modes"][i]["buffers"]["input_bytes"],
            "output_bytes": r["modes"][i]["buffers"]["output_bytes"],
        }
        for r in sorted(ranks, key=lambda r: r["rank"])
    }
    largest = max(by_rank, key=lambda name: by_rank[name]["bytes"])
    head = ranks[0]["modes"][i]["buffers"]
    return {
        "in": head["in"],
        "out": head["out"],
        "bytes": by_rank[largest]["bytes"],
        "input_bytes": by_rank[largest]["input_bytes"],
        "output_bytes": by_rank[largest]["output_bytes"],
        "rank": largest,
        "by_rank": by_rank,
    }


def _split_summary(cfg: RunConfig, attention: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How each attention rank's batches were split (None without ``--async-moe-split``)."""
    if not cfg.async_moe_split:
        return None
    plans = [
        {"rank": f"attention {r['index']}", "batch": b, **summary, "layouts": r["layouts"][b]}
        for r in sorted(attention, key=lambda r: r["rank"])
        for b, summary in sorted(r["split"].items())
    ]
    return {
        "policy": cfg.async_moe_split,
        "batches": len(plans),
        "batches_with_a_continued_request": sum(bool(p["continued"]) for p in plans),
        "unsplit_batches": sum(p.get("stages", 2) == 1 for p in plans),
        "plans": plans,
    }


def rank_traces(ranks: list[dict[str, Any]]) -> list[Trace]:
    """One Trace per (mode, rank), rebuilt from the gathered spans, mode by mode."""
    traces = []
    for i in range(len(ranks[0]["modes"])):
        for r in sorted(ranks, key=lambda r: r["rank"]):
            mode = r["modes"][i]
            trace = Trace(rank=r["rank"], label=f"{mode['label']}: {r['role']} {r['index']}")
            for name, stream, stream_id, layer, stage, seq, slots, start, end in mode["spans"]:
                slots = tuple(slots) if slots is not None else None
                trace.add(Span(name, stream, stream_id, WorkItem(layer, stage, seq), slots, start, end))
            traces.append(trace)
    return traces


def write_outputs(cfg: RunConfig, report: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the merged trace, the timeline (if matplotlib is there) and result.json; return the report."""
    from afd_mrv2.reference.timeline import draw_timeline

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    traces = rank_traces(ranks)
    report["trace"] = str(write_chrome_trace(out / "trace.json", traces, distinct_pids=True).resolve())
    try:
        report["timeline"] = str(draw_timeline(out / "timeline.png", ranks, report).resolve())
    except ImportError:
        report["timeline_note"] = "matplotlib is not installed: pip install 'afd-mrv2[plot]' to get the timeline PNG"
    (out / "result.json").write_text(json.dumps(report, indent=2))
    return report


def _split_lines(split: dict[str, Any], *, warmup: int, limit: int = 8) -> list[str]:
    from afd_mrv2.reference.staged import describe_summary

    plans = split["plans"]
    lines = [
        f"{p['rank']}, batch {p['batch']}{' (warm-up)' if p['batch'] < warmup else ''}: {describe_summary(p)}"
        for p in plans[:limit]
    ]
    if len(plans) > limit:
        lines.append(f"... {len(plans) - limit} more batches in result.json")
    lines.append(
        f"{split['batches_with_a_continued_request']} of {split['batches']} batches have a request continued across the stages"
    )
    if split.get("unsplit_batches"):
        lines.append(
            f"{split['unsplit_batches']} of {split['batches']} batches ran unsplit (1 stage): a rank of their DP group "
            "had no two-stage plan, so every rank ran them unsplit"
        )
    return lines


def _bytes_by_rank(mode: dict[str, Any]) -> str:
    """``multistream 3in/3out: attention 0 96 KiB, ffn 0 1.3 MiB`` (one mode: the last in the table)."""
    ranks = mode["buffers"]["by_rank"]
    return f"{mode['mode']}: " + ", ".join(f"{name} {format_bytes(r['bytes'])}" for name, r in ranks.items())


def render(report: dict[str, Any], *, as_json: bool) -> str:
    """The report as one JSON object, or as a readable table."""
    if as_json:
        return json.dumps(report)
    split = report.get("split")
    lines = [_headline(report), ""]
    if split:
        lines += [*_split_lines(split, warmup=report["warmup_batches"]), ""]
    lines.append(_modes_table(report["modes"]))
    stats = report["routing_stats"]
    verdict = "OK" if report["ok"] else "FAILED"
    lines += [
        "",
        *_diff_lines(report, verdict),
        f"routing: hottest expert {stats['hot_expert']} selected by {stats['hot_expert_share']:.0%} of tokens; "
        f"tokens per FFN rank {stats['tokens_per_ffn_rank']}",
        "overlap eff = flow-shop lower bound / makespan (FFN ranks); hidden comm = recv+send time under compute;",
        "buffers = input + output buffers / the largest rank's buffer bytes (tensor storages, after the run);",
        f"  per rank, {_bytes_by_rank(report['modes'][-1])}",
        f"cores busy = CPU time of all ranks / wall time; this machine has {os.cpu_count()} cores and a 1-minute "
        f"load average of {report['modes'][-1]['machine_load_average']:.1f} (when they are all busy, overlap cannot help)",
        f"trace:    {report['trace']}  (open in https://ui.perfetto.dev)",
        f"timeline: {report['timeline'] or report.get('timeline_note')}",
    ]
    return "\n".join(lines)


def _headline(report: dict[str, Any]) -> str:
    """The first line: ranks, link, layers, how batches are cut, batches, routing."""
    link = report["link"]
    transport = report.get("transport", "gloo")
    link_text = (
        f"simulated link {link['sim_latency_us']:.0f} us/transfer on {transport}"
        if link["kind"] == "sim"
        else f"{transport}, loopback"
    )
    split = report.get("split")
    batching = (
        f"{split['policy']} split of {report['requests_per_batch']} request{'s' if report['requests_per_batch'] != 1 else ''} "
        "per batch into 2 stages"
        if split
        else f"{report['stages']} micro-batches x {report['requests_per_stage']} requests"
    )
    attention = f"{report['num_attention_ranks']} attention"
    if report.get("attention_tp", 1) > 1:
        attention = f"{report['attention_dp']} attention DP x {report['attention_tp']} TP ({report['layout']} layout)"
    return (
        f"AFD run: {attention} + {report['num_ffn_ranks']} FFN ranks ({link_text}), "
        f"{report['layers']} layers, {batching}, {report['batches']} batches, routing {report['routing']}"
    )


def _modes_table(modes: list[dict[str, Any]]) -> str:
    """One row per mode: buffers, time per layer, speedup, overlap, cores busy, max |diff|."""
    headers = [
        "mode",
        "buffers (in+out)",
        "per-layer ms",
        "speedup",
        "overlap eff",
        "hidden comm",
        "cores busy",
        "max |diff|",
    ]
    rows = [
        [
            m["mode"],
            buffers_cell(m["buffers"]),
            m["per_layer_ms"],
            m["speedup"],
            m["overlap_efficiency"],
            m["hidden_comm_fraction"],
            m["cpu_cores_busy"],
            f"{m['max_abs_diff']:.2e}",
        ]
        for m in modes
    ]
    return format_table(headers, rows)


def _diff_lines(report: dict[str, Any], verdict: str) -> list[str]:
    quant = report.get("quant")
    if not quant:
        return [
            f"max |diff| vs single-process reference: {report['max_abs_diff']:.2e} "
            f"(tolerance {report['tolerance']:g}) {verdict}"
        ]
    e2e = quant["end_to_end_max_abs_diff"]
    return [
        f"{quant['mode']}: max |diff| of each MoE output vs the float MoE (same input and routing): "
        f"{quant['max_abs_diff']:.2e} (tolerance: the int8 bound, elementwise, largest {quant['max_bound']:.2e}; "
        f"worst diff/bound {quant['worst_ratio']:.1e}) {verdict}",
        f"  end to end vs the float single-process reference: {e2e:.2e} (not bounded by the int8 step: a "
        "near-tied router may pick another expert downstream)"
        if e2e is not None
        else "  end to end: not measured",
    ]
