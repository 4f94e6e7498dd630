"""``afd-mrv2 probe ascend``: what only an Ascend box can show of afd-mrv2 on vLLM-Ascend, as evidence rows.

:func:`run_probe` checks the runtime pair, the registration order, one AFD step through the
adapters with token identity against plain vLLM-Ascend on a small MoE checkpoint, and the same on a
W8A8 checkpoint; :func:`skipped_report` where it cannot run.  See docs/ascend-deployment.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_mrv2.hooks.cam.evidence import FAIL, PASS, SKIPPED, Check, Report, distribution_versions, environment_block
from afd_mrv2.probe.ascend_registration import parse

PRODUCER = "afd-mrv2 probe ascend"
VERSIONS = ("vllm", "vllm-ascend", "torch", "torch-npu", "afd-mrv2")
#: the capabilities an Ascend pair must grant for AFD on the vLLM path
REQUIRED = ("mrv2", "moe_seam")
#: greedy completions x tokens per identity row; every completion must match plain vLLM-Ascend
COMPLETIONS, TOKENS = 16, 16
#: both sides on one NPU (the checkpoint is small): each engine takes this share of its memory
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "16", "--seed", "0", "--enforce-eager"]
MEMORY_SHARE = "0.4"
ADAPTER = "afd_mrv2.mrv2.platforms.ascend.attention.AfdAscendRoutedExperts"
ASCEND_LAYERS = ("AscendRoutedExperts", "AscendRoutedExperts310")
ROW_NAMES = ("ascend:runtime", "ascend:registration", "ascend:afd-step:float", "ascend:token-identity:float")
W8A8_ROWS = ("ascend:afd-step:w8a8", "ascend:token-identity:w8a8")


class NoAscend(RuntimeError):
    """No usable vLLM-Ascend box here; the message says what is missing."""


@dataclass
class ProbeSpec:
    """What to probe: the float checkpoint, the optional W8A8 one, where logs go."""

    model: Path
    w8a8_model: Path | None
    logs: Path
    engine_args: list[str] = field(default_factory=lambda: [*ENGINE_ARGS, "--gpu-memory-utilization", MEMORY_SHARE])


def missing() -> str | None:
    """Why this machine cannot run the probe, or None."""
    import importlib.util

    from afd_mrv2.probe.npu import NoNpu, require_npus

    for module, what in (("vllm_ascend", "vllm-ascend"), ("vllm", "vLLM")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed (the probe needs vLLM-Ascend, torch_npu, CANN and an Ascend NPU)"
    try:
        require_npus(1)
    except NoNpu as exc:
        return str(exc)
    return None


def runtime_row() -> Check:
    """The installed pair, decided by afd-mrv2's compat table for :data:`REQUIRED`."""
    from afd_mrv2.compat import check_runtime

    decision = check_runtime(REQUIRED)
    measured = {"status": decision.status, "pair": decision.pair.name if decision.pair else None}
    measured["installed"] = decision.runtime.key()
    detail = "" if decision.accepted else " | ".join(decision.reasons)
    return Check("ascend:runtime", PASS if decision.accepted else FAIL, measured, detail)


def registration_verdict(found: dict[str, Any] | None, stderr: str) -> Check:
    """The registration child's result: vLLM-Ascend's classes registered, then afd-mrv2's adapter over them."""
    name = "ascend:registration"
    if found is None:
        return Check(name, FAIL, None, f"the child printed no result: {stderr.strip()[-400:]}")
    if "failed" in found:
        return Check(name, FAIL, found, f"step {found['failed']['step']} failed: {found['failed']['message']}")
    routed = found["registry"].get("RoutedExperts")
    bases = found.get("routed_experts_bases", [])
    over = next((b for b in bases if b and b.rsplit(".", 1)[-1] in ASCEND_LAYERS), None)
    if routed != ADAPTER or over is None:
        return Check(name, FAIL, found, f"RoutedExperts is {routed} over {bases}, not {ADAPTER} over vllm-ascend's")
    return Check(name, PASS, {"routed_experts": routed, "over": over, "ops": len(found["registry"])}, "")


def registration_row(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> Check:
    """A fresh process: vLLM's general plugins, vllm-ascend's registration, afd-mrv2's adapter (a worker's order)."""
    cmd = [sys.executable, "-m", "afd_mrv2.probe.ascend_registration", "plugins,ascend,afd", "{}"]
    done = run(cmd, capture_output=True, text=True, timeout=600)
    return registration_verdict(parse(done.stdout), done.stderr)


def is_w8a8(model: Path) -> str | None:
    """Why ``model`` is not a ModelSlim W8A8 checkpoint, or None."""
    description = model / "quant_model_description.json"
    if not description.is_file():
        return f"{description} is missing (vLLM-Ascend detects ModelSlim quantization from it)"
    kinds = {str(v) for v in json.loads(description.read_text()).values() if isinstance(v, str)}
    return None if any(k.startswith("W8A8") for k in kinds) else f"no W8A8 layer in {description}: {sorted(kinds)}"


def identity_rows(label: str, plain: list[Any], afd: list[Any], ffn_items: int) -> list[Check]:
    """``ascend:afd-step:<label>`` (the FFN rank computed items) and ``ascend:token-identity:<label>``."""
    from afd_mrv2.harness import compare

    step = Check(
        f"ascend:afd-step:{label}",
        PASS if ffn_items > 0 else FAIL,
        {"ffn_items": ffn_items},
        "" if ffn_items > 0 else "the FFN rank reported no computed item: the AFD path did not run",
    )
    found = compare(plain, afd)
    same = found["identical"] == found["completions"] == len(plain) > 0
    detail = "" if same else f"{found['identical']}/{found['completions']} greedy completions identical"
    return [step, Check(f"ascend:token-identity:{label}", PASS if same else FAIL, found, detail)]


def skipped_report(why: str, names: tuple[str, ...] = ROW_NAMES + W8A8_ROWS) -> Report:
    """The document where the probe could not run: every row ``skipped: <why>``."""
    checks = tuple(Check(n, SKIPPED, None, f"skipped: {why}") for n in names)
    return Report(PRODUCER, checks, distribution_versions(VERSIONS), environment_block(accelerator="none"))


def _ffn_items(reports: list[Any]) -> int:
    return sum(int(r.report.get("items", 0) or 0) for r in reports)


def compare_with_plain(label: str, model: Path, spec: ProbeSpec) -> list[Check]:
    """Plain vLLM-Ascend, then ``afd-mrv2 serve`` 1A1F, on ``model``: the two identity rows."""
    from afd_mrv2.harness import PlainServer, ServerError, ServeServer, ServeTopology, greedy_round
    from afd_mrv2.ports import free_port_block

    try:
        plain_server = PlainServer(model, free_port_block(1), spec.logs / f"{label}-plain.log", spec.engine_args, "all")
        try:
            plain_server.wait_ready()
            plain = greedy_round(plain_server, model, COMPLETIONS, TOKENS)
        finally:
            plain_server.stop()
        topology = ServeTopology(attention=1, ffn=1)
        port = free_port_block(topology.ports())
        serve = ServeServer(model, port, spec.logs / f"{label}-serve.log", topology, spec.engine_args)
        try:
            serve.wait_ready()
            afd = greedy_round(serve, model, COMPLETIONS, TOKENS)
        finally:
            serve.stop()
        items = _ffn_items(serve.ffn_reports())
    except ServerError as exc:
        return [Check(f"ascend:afd-step:{label}", FAIL, None, str(exc)), _not_compared(label, str(exc))]
    return identity_rows(label, plain, afd, items)


def _not_compared(label: str, why: str) -> Check:
    return Check(f"ascend:token-identity:{label}", FAIL, None, f"not compared: {why}")


def run_probe(spec: ProbeSpec) -> Report:
    """Every row, in order; a failed runtime or registration row skips the serving rows (they could not pass)."""
    why = missing()
    if why is not None:
        raise NoAscend(why)
    spec.logs.mkdir(parents=True, exist_ok=True)
    checks = [runtime_row(), registration_row()]
    if any(c.status == FAIL for c in checks):
        blocked = f"skipped: {', '.join(c.name for c in checks if c.status == FAIL)} failed"
        checks += [Check(n, SKIPPED, None, blocked) for n in ROW_NAMES[2:] + W8A8_ROWS]
    else:
        checks += compare_with_plain("float", spec.model, spec)
        checks += _w8a8_rows(spec)
    env = environment_block(accelerator="ascend", visible=os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "all"))
    return Report(PRODUCER, tuple(checks), distribution_versions(VERSIONS), env)


def _w8a8_rows(spec: ProbeSpec) -> list[Check]:
    if spec.w8a8_model is None:
        return [Check(n, SKIPPED, None, "skipped: no --w8a8-model given") for n in W8A8_ROWS]
    not_w8a8 = is_w8a8(spec.w8a8_model)
    if not_w8a8 is not None:
        return [Check(n, FAIL, None, not_w8a8) for n in W8A8_ROWS]
    return compare_with_plain("w8a8", spec.w8a8_model, spec)
