"""``afd-mrv2 compat``: the runtime gate and the upstream-seam contracts, as CI steps.

afd-mrv2 compat check [--json] [--require CAP ...]     exit 0 accepted, 1 refused
afd-mrv2 compat contracts [--dist PATH_OR_WHEEL ...] [--json]   exit 0 pass, 1 violations
afd-mrv2 compat table [--json]                          the runtime-pair table
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from afd_mrv2.cli import add_command
from afd_mrv2.errors import AfdError
from afd_mrv2.table import format_table

if TYPE_CHECKING:
    from afd_mrv2.compat.contracts import ContractReport


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(sub, "compat", "runtime-pair gate and upstream-seam contracts (CI steps)")
    inner = parser.add_subparsers(dest="compat_command", required=True, metavar="ACTION")

    check = add_command(
        inner,
        "check",
        "decide whether the installed runtime pair is accepted (exit 0) or refused (exit 1)",
        "Reads installed distribution metadata (never imports vllm/vllm_ascend/torch_npu) and the "
        "CANN install-info file, and applies afd-mrv2's runtime-pair table.",
    )
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument("--require", nargs="+", default=[], metavar="CAP", help="capabilities that must be granted")
    check.set_defaults(handler=run_check)

    contracts = add_command(
        inner,
        "contracts",
        "check afd-mrv2's upstream seams against a wheel or an installed distribution (ast, no import)",
    )
    contracts.add_argument(
        "--dist",
        metavar="PATH_OR_WHEEL",
        action="append",
        help="a wheel, a site-packages directory, a source checkout or an unpacked sdist; repeat it to read "
        "several as one, e.g. the vllm wheel and the vllm-ascend sdist (default: where vllm and vllm_ascend "
        "are installed)",
    )
    contracts.add_argument("--json", action="store_true", help="print one JSON object")
    contracts.set_defaults(handler=run_contracts)

    table = add_command(inner, "table", "print the runtime-pair table")
    table.add_argument("--json", action="store_true")
    table.set_defaults(handler=run_table)


def run_check(args: argparse.Namespace) -> int:
    from afd_mrv2.compat import CAPABILITIES, check_runtime

    unknown = [c for c in args.require if c not in CAPABILITIES]
    if unknown:
        raise AfdError(f"--require: unknown capability {', '.join(unknown)}; known: {', '.join(CAPABILITIES)}")
    decision = check_runtime(tuple(args.require))
    print(json.dumps(decision.as_dict(), indent=2) if args.json else decision.message())
    return 0 if decision.accepted else 1


def _default_dists() -> list[Path]:
    """Where vllm and vllm_ascend are installed (one directory each, the same one counted once)."""
    roots: list[Path] = []
    for top in ("vllm", "vllm_ascend"):
        spec = importlib.util.find_spec(top)  # a top-level spec lookup runs no package code
        if spec is not None and spec.submodule_search_locations:
            root = Path(next(iter(spec.submodule_search_locations))).parent
            if root not in roots:
                roots.append(root)
    if not roots:
        raise AfdError(
            "vllm is not installed here; pass --dist PATH_OR_WHEEL (e.g. a wheel from "
            "`pip download --no-deps vllm==0.33.0`)"
        )
    return roots


def _print_report(report: ContractReport) -> None:
    print(f"source: {report.source}")
    if report.versions:
        print("versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()))
    for package, dist in report.providers.items():
        print(f"{package} shipped by the {dist} distribution: platform {report.platform}")
    if report.versions and report.platform is None:
        print("platform: unknown (no vllm dist-info): every seam checked")
    if report.skipped:
        print(f"skipped (other platforms): {'; '.join(report.skipped)}")
    for dist, count in report.checked.items():
        print(f"{dist}: {count} seams checked")
    for dist in report.absent:
        print(f"{dist}: not in this source (its seams were not checked)")
    for capability, messages in report.capabilities_missing.items():
        print(f"capability {capability} not offered: {'; '.join(messages)}")
    for capability, symbols in report.blocked.items():
        print(f"capability {capability} blocked upstream by: {', '.join(symbols)}")
    for capability, messages in report.unblocked.items():
        print(
            f"capability {capability}: a fact that blocked it is gone (revisit the rows withholding it): "
            f"{'; '.join(messages)}"
        )
    for violation in report.violations:
        print(f"VIOLATION {violation}")
    if not report.checked:
        print("no vllm or vllm_ascend package found in this source")
    print("contracts: " + ("pass" if report.ok else "FAIL"))


def run_contracts(args: argparse.Namespace) -> int:
    from afd_mrv2.compat.contracts import check_contracts, open_sources

    try:
        paths: list[str] | list[Path] = args.dist or _default_dists()
        source = open_sources(paths)
    except ValueError as exc:
        raise AfdError(f"--dist: {exc}") from None
    report = check_contracts(source)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _print_report(report)
    return 0 if report.ok else 1


def run_table(args: argparse.Namespace) -> int:
    from afd_mrv2.compat import PAIRS

    if args.json:
        print(json.dumps([p.as_dict() for p in PAIRS], indent=2))
        return 0
    rows = [
        [p.name, p.vllm, p.vllm_ascend or "-", p.torch or "?", p.status.value, ",".join(sorted(p.capabilities)) or "-"]
        for p in PAIRS
    ]
    print(format_table(["pair", "vllm", "vllm-ascend", "torch", "status", "capabilities"], rows))
    return 0
