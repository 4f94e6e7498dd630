"""``afd-mrv2 plan MODEL --attention A --ffn F``: each role's weight bytes, reading no weights.

See docs/serve.md, "Sizing a deployment: afd-mrv2 plan".
"""

from __future__ import annotations

import argparse
import json
import re
from typing import TYPE_CHECKING

from afd_mrv2.cli import add_command
from afd_mrv2.errors import AfdError, ConfigError

if TYPE_CHECKING:
    from afd_mrv2.checkpoints.sizing import ModelBytes, RolePlan

GIB = 1024**3
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS.update({"kib": 1024, "mib": 1024**2, "gib": GIB, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": GIB})
FITS = ("today", "experts-only")
NOTE = (
    "today: an FFN rank loads the whole model ('today peak'), then drops the routed experts it does not hold "
    "('today'); 'experts only' is what it holds once each FFN rank loads only its experts (planned). "
    "An Attention engine holds no routed expert."
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        sub,
        "plan",
        "print each role's weight bytes for A Attention engines and F FFN ranks, reading no weights",
        (
            "Counts each kind of weight of MODEL (a checkpoint folder, or a folder or path with only its "
            "config.json) from the safetensors headers where the folder has *.safetensors (exact), else from "
            "config.json alone (its dtype, or fp8 with float32 block scales where its quantization_config says "
            "so), and splits them over the roles: an Attention engine holds everything but the routed experts, "
            "an FFN rank the experts its placement gives it.  Multi-token-prediction layers are left out."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="checkpoint folder (or its config.json)")
    parser.add_argument("--attention", type=int, required=True, metavar="A", help="Attention engines")
    parser.add_argument("--ffn", type=int, required=True, metavar="F", help="FFN ranks")
    parser.add_argument("--expert-replicas", type=int, default=1, metavar="R", help="holders per expert (1..F)")
    parser.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="refuse a plan some role of which does not fit SIZE per device (64GiB, 80GB, 512MiB or bytes)",
    )
    parser.add_argument(
        "--fit",
        default="today",
        metavar="{" + ",".join(FITS) + "}",
        help="what --device-memory is checked against: today's load peak (default) or the experts-only layout",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (exact bytes)")
    parser.set_defaults(handler=run)


def parse_size(text: str) -> int:
    """``64GiB``, ``80 GB``, ``512MiB``, ``1e9`` or plain bytes, as bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise ConfigError("--device-memory", f"expected a size such as 64GiB, 80GB, 512MiB or bytes, got {text!r}")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def _ranks(plan: RolePlan) -> str:
    from afd_mrv2.placement import Placement

    return Placement.ranges(plan.ranks)


def _check_fit(plans: list[RolePlan], memory: int, fit: str) -> None:
    over = []
    for p in plans:
        need = p.experts_only if fit == "experts-only" else p.today_peak
        if need > memory:
            name = f"{p.role} {'ranks' if len(p.ranks) > 1 else 'rank'} {_ranks(p)}"
            needs = f"needs {gib(need)}" if len(p.ranks) == 1 else f"need {gib(need)} each"
            over.append(f"{name} {needs}, {gib(need - memory)} over")
    if over:
        layout = "experts only" if fit == "experts-only" else "today, load peak"
        raise AfdError(f"plan does not fit --device-memory {gib(memory)} ({layout}): {'; '.join(over)}")


def _as_json(sizes: ModelBytes, params: ModelBytes, args: argparse.Namespace, plans: list[RolePlan]) -> str:
    roles = [
        {
            "role": p.role,
            "ranks": list(p.ranks),
            "experts_each": p.experts,
            "routed_expert_bytes": p.routed_bytes,
            "experts_only_bytes": p.experts_only,
            "today_bytes": p.today,
            "today_peak_bytes": p.today_peak,
        }
        for p in plans
    ]
    return json.dumps(
        {
            "model": sizes.model,
            "arch": sizes.arch,
            "source": sizes.source,
            "width": sizes.width,
            "parameters": params.total,
            "moe_layers": sizes.moe_layers,
            "num_experts": sizes.num_experts,
            "total_bytes": sizes.total,
            "mtp_layers_left_out": sizes.mtp_layers,
            "mtp_bytes_left_out": sizes.mtp,
            "kinds": dict(sizes.kinds),
            "attention": args.attention,
            "ffn": args.ffn,
            "expert_replicas": args.expert_replicas,
            "roles": roles,
        }
    )


def _text(sizes: ModelBytes, params: ModelBytes, args: argparse.Namespace, plans: list[RolePlan]) -> str:
    from afd_mrv2.table import format_table

    total = sizes.total
    kinds = [(k.replace("_", " "), f"{v:,}", gib(v), f"{100 * v / total:.2f}%") for k, v in sizes.kinds.items() if v]
    roles = [(p.role, _ranks(p), p.experts, gib(p.experts_only), gib(p.today), gib(p.today_peak)) for p in plans]
    mtp = ""
    if sizes.mtp_layers or sizes.mtp:
        mtp = f" ({sizes.mtp_layers} MTP layer{'s' * (sizes.mtp_layers != 1)} left out{': ' + gib(sizes.mtp) if sizes.mtp else ''})"
    head = (
        f"afd-mrv2 plan: {sizes.model} ({sizes.arch}, from {sizes.source}: {sizes.width})\n"
        f"{params.total / 1e9:,.2f} B parameters, {gib(total)} of weights{mtp}; {sizes.moe_layers} MoE layers x "
        f"{sizes.num_experts} routed experts; A={args.attention}, F={args.ffn}, R={args.expert_replicas}"
    )
    return "\n\n".join(
        [
            head,
            format_table(["kind", "bytes", "GiB", "share"], kinds),
            format_table(["role", "ranks", "experts each", "experts only", "today", "today peak"], roles),
            NOTE,
        ]
    )


def run(args: argparse.Namespace) -> int:
    from afd_mrv2.checkpoints.sizing import plan_roles, size_checkpoint

    if args.fit not in FITS:
        raise ConfigError("--fit", f"expected one of {', '.join(FITS)}, got {args.fit!r}")
    memory = None if args.device_memory is None else parse_size(args.device_memory)
    sizes = size_checkpoint(args.model)
    params = size_checkpoint(args.model, parameters=True)
    plans = plan_roles(sizes, args.attention, args.ffn, args.expert_replicas)
    if memory is not None:
        _check_fit(plans, memory, args.fit)
    print(_as_json(sizes, params, args, plans) if args.json else _text(sizes, params, args, plans))
    return 0
