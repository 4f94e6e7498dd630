"""``afd-mrv2 probe npu`` (the CAM operators) and ``afd-mrv2 probe ascend`` (AFD on vLLM-Ascend), for hardware owners.

Runs :mod:`afd_mrv2.probe.npu` on two local Ascend NPUs and writes the evidence
document (schema ``afd-mrv2/evidence/v1``, :mod:`afd_mrv2.hooks.cam.evidence`) a
CAM connector reads through ``connector_extra_config.stream_evidence``.  Without
a usable NPU it writes the same document with every row ``skipped: no NPU: <why>``
and exits 3: never a silent pass.  Exit codes: 0 every check passed, 1 a check
failed, 3 no usable NPU here (the message says what is missing), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from afd_mrv2.cli import add_command

EXIT_FAILED = 1
EXIT_NO_NPU = 3


DESCRIPTION = (
    "npu: probe the Ascend CAM operators (afd_ascend.a2e/e2a, umdk_cam_op_lib.async_*) on two local NPUs: "
    "are they present, do they run on the caller's current stream, are two in-flight transfers safe, "
    "does stage identity survive the wire, and do serialized and multistream runs of a toy MoE agree.  "
    "Writes the evidence document (schema afd-mrv2/evidence/v1; docs/ascend-deployment.md); without an NPU, "
    "the same document with every check skipped, and exit 3.  ascend: AFD on vLLM-Ascend (afd-mrv2 probe "
    "ascend --help)."
)


ASCEND_DESCRIPTION = (
    "On an Ascend box with the accepted pair installed (afd-mrv2 compat table): checks the runtime pair, that "
    "vLLM-Ascend's RoutedExperts is registered and afd-mrv2's adapter replaces it in a worker's order, then "
    "serves the checkpoint with plain vLLM-Ascend and with afd-mrv2 serve (1 Attention engine + 1 FFN rank, both "
    "on one NPU) and compares 16 greedy completions token by token; the same for --w8a8-model.  Writes the "
    "evidence document (docs/ascend-deployment.md); without vLLM-Ascend or an NPU, every row skipped, exit 3."
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    summary = "on Ascend hardware: probe the CAM operators (npu) or AFD on vLLM-Ascend (ascend); write evidence"
    parser = add_command(sub, "probe", summary, DESCRIPTION)
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    npu = targets.add_parser("npu", help="run on two local Ascend NPUs (needs torch_npu and CANN)")
    npu.add_argument(
        "--out", default="afd-mrv2-cam-evidence.json", help="evidence document to write (default %(default)s)"
    )
    npu.add_argument(
        "--window-ms", type=float, default=200.0, help="how long the escape check keeps a stream busy (default 200)"
    )
    npu.add_argument("--port", type=int, default=29533, help="rendezvous port on 127.0.0.1 (default 29533)")
    npu.set_defaults(handler=run_npu)
    ascend = targets.add_parser(
        "ascend",
        help="AFD on vLLM-Ascend on this box: the pair, the registration order, one AFD step, token identity",
        description=ASCEND_DESCRIPTION,
    )
    ascend.add_argument("--model", help="a small MoE checkpoint (default: make a tiny qwen2_moe one under --logs)")
    ascend.add_argument("--w8a8-model", help="a ModelSlim W8A8 MoE checkpoint (quant_model_description.json)")
    ascend.add_argument("--logs", default="afd-mrv2-ascend-probe", help="server logs folder (default %(default)s)")
    ascend.add_argument(
        "--out", default="afd-mrv2-ascend-evidence.json", help="evidence document to write (default %(default)s)"
    )
    ascend.set_defaults(handler=run_ascend)


def run_npu(args: argparse.Namespace) -> int:
    from afd_mrv2.hooks.cam.evidence import Evidence
    from afd_mrv2.hooks.cam.ops import installed_versions
    from afd_mrv2.probe.npu import NoNpu, run_probe, skipped_evidence

    if args.window_ms <= 0 or not 1 <= args.port <= 65535:
        raise SystemExit("afd-mrv2 probe npu: --window-ms must be > 0 and --port in 1..65535")
    try:
        path = run_probe(args.out, window_s=args.window_ms / 1e3, port=args.port)
    except NoNpu as exc:
        skipped = skipped_evidence(f"no NPU: {exc}", installed_versions()).write(args.out)
        print(
            f"afd-mrv2 probe npu: no usable Ascend NPU: {exc}; every check skipped (written to {skipped})",
            file=sys.stderr,
        )
        return EXIT_NO_NPU
    report = Evidence.load(path).report()
    rows = {c.name: c.status for c in report.checks}
    print(json.dumps({"evidence": str(path), "summary": report.summary, "checks": rows}, indent=2))
    return EXIT_FAILED if report.failed else 0


def run_ascend(args: argparse.Namespace) -> int:
    from afd_mrv2.probe.ascend import NoAscend, ProbeSpec, missing, run_probe, skipped_report

    why = missing()
    if why is not None:
        skipped = skipped_report(f"no Ascend NPU: {why}").write(args.out)
        print(f"afd-mrv2 probe ascend: {why}; every check skipped (written to {skipped})", file=sys.stderr)
        return EXIT_NO_NPU
    logs = Path(args.logs)
    model = Path(args.model) if args.model else _tiny_model(logs / "qwen2_moe-tiny")
    spec = ProbeSpec(model, Path(args.w8a8_model) if args.w8a8_model else None, logs)
    try:
        report = run_probe(spec)
    except NoAscend as exc:  # pragma: no cover - missing() said yes a moment ago
        raise SystemExit(f"afd-mrv2 probe ascend: {exc}") from None
    path = report.write(args.out)
    rows = {c.name: c.status for c in report.checks}
    print(json.dumps({"evidence": str(path), "summary": report.summary, "checks": rows}, indent=2))
    return EXIT_FAILED if report.failed else 0


def _tiny_model(folder: Path) -> Path:
    import subprocess

    if not (folder / "config.json").is_file():
        exe = Path(sys.executable).with_name("afd-mrv2")
        subprocess.run([str(exe), "make-model", str(folder), "--arch", "qwen2_moe"], check=True, timeout=600)
    return folder
