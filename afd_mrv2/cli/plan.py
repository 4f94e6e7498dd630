"""``afd-mrv2 plan MODEL --attention A --ffn F``: each role's weight bytes, held and read at start, reading no weights.

See docs/serve.md, "Sizing a deployment: afd-mrv2 plan".
"""

from __future__ import annotations

import argparse
import json
import re
from typing import TYPE_CHECKING, Any

from afd_mrv2.cli import add_command
from afd_mrv2.errors import AfdError, ConfigError

if TYPE_CHECKING:
    from afd_mrv2.checkpoints.sizing import ModelBytes, RolePlan

GIB = 1024**3
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS.update({"kib": 1024, "mib": 1024**2, "gib": GIB, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": GIB})
NOTE = (
    "weights each: what each rank holds (an Attention engine: everything but the routed experts; an FFN rank: its "
    "routed experts, nothing else). reads at start: what it reads from the checkpoint, every tensor but the "
    "routed-expert weights it does not hold (an FFN rank drops all but its experts)."
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
            "an FFN rank only the experts its placement gives it; it also prints what each reads at start "
            "(every tensor but the routed-expert weights it does not hold).  Multi-token-prediction layers are "
            "left out."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="checkpoint folder (or its config.json)")
    parser.add_argument("--attention", type=int, required=True, metavar="A", help="Attention data-parallel ranks")
    parser.add_argument(
        "--attention-groups",
        type=int,
        default=1,
        metavar="G",
        help="vLLM deployments the A ranks form (as serve's flag; default %(default)s)",
    )
    parser.add_argument(
        "--attention-tp", type=int, default=1, metavar="T", help="tensor-parallel ranks of each Attention DP rank"
    )
    parser.add_argument("--ffn", type=int, required=True, metavar="F", help="FFN ranks")
    parser.add_argument("--expert-replicas", type=int, default=1, metavar="R", help="holders per expert (1..F)")
    parser.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="refuse a plan some role of which holds more weights than SIZE per device (64GiB, 80GB, 512MiB or bytes)",
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


def _check_fit(plans: list[RolePlan], memory: int) -> None:
    over = []
    for p in plans:
        if p.weights > memory:
            name = f"{p.role} {'ranks' if len(p.ranks) > 1 else 'rank'} {_ranks(p)}"
            needs = f"needs {gib(p.weights)}" if len(p.ranks) == 1 else f"need {gib(p.weights)} each"
            over.append(f"{name} {needs}, {gib(p.weights - memory)} over")
    if over:
        raise AfdError(f"plan does not fit --device-memory {gib(memory)} (weights held): {'; '.join(over)}")


def groups(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The Attention groups serve would start: each one vLLM deployment, its DP x TP processes' AFD ranks."""
    if args.attention_groups < 1 or args.attention % args.attention_groups or args.attention_tp < 1:
        raise AfdError(
            f"--attention-groups must divide --attention ({args.attention}) and --attention-tp be >= 1, got "
            f"{args.attention_groups} and {args.attention_tp}"
        )
    dp = args.attention // args.attention_groups
    size = dp * args.attention_tp
    return [
        {
            "group": g,
            "data_parallel": dp,
            "tensor_parallel": args.attention_tp,
            "afd_ranks": [*range(g * size, (g + 1) * size)],
        }
        for g in range(args.attention_groups)
    ]


def _groups_line(args: argparse.Namespace) -> str:
    layout = groups(args)
    first = layout[0]
    shape = f"DP {first['data_parallel']}" + (f" x TP {first['tensor_parallel']}" if args.attention_tp > 1 else "")
    from afd_mrv2.placement import Placement

    listed = "; ".join(f"group {g['group']}: AFD ranks {Placement.ranges(g['afd_ranks'])}" for g in layout)
    return (
        f"Attention: {len(layout)} vLLM deployment{'s' * (len(layout) != 1)} of {shape} ({listed}); each FFN rank "
        f"computes each MoE layer {len(layout)} time{'s' * (len(layout) != 1)} per step, once per group"
    )


def _as_json(sizes: ModelBytes, params: ModelBytes, args: argparse.Namespace, plans: list[RolePlan]) -> str:
    roles = [
        {
            "role": p.role,
            "ranks": list(p.ranks),
            "experts_each": p.experts,
            "routed_expert_bytes": p.routed_bytes,
            "weight_bytes": p.weights,
            "read_bytes": p.reads,
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
            "routed_expert_scale_bytes": sum(sizes.expert_scale_bytes),
            "mtp_layers_left_out": sizes.mtp_layers,
            "mtp_bytes_left_out": sizes.mtp,
            "kinds": dict(sizes.kinds),
            "attention": args.attention,
            "attention_groups": groups(args),
            "ffn": args.ffn,
            "expert_replicas": args.expert_replicas,
            "roles": roles,
        }
    )


def _text(sizes: ModelBytes, params: ModelBytes, args: argparse.Namespace, plans: list[RolePlan]) -> str:
    from afd_mrv2.table import format_table

    total = sizes.total
    kinds = [(k.replace("_", " "), f"{v:,}", gib(v), f"{100 * v / total:.2f}%") for k, v in sizes.kinds.items() if v]
    roles = [(p.role, _ranks(p), p.experts, gib(p.weights), gib(p.reads)) for p in plans]
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
            format_table(["role", "ranks", "experts each", "weights each", "reads at start"], roles),
            _groups_line(args),
            NOTE + _scales_note(sizes),
        ]
    )


def _scales_note(sizes: ModelBytes) -> str:
    scales = sum(sizes.expert_scale_bytes)
    return (
        f" Each role reads every routed expert's scales ({gib(scales)} in all), keeping those of the experts it holds."
        if scales
        else ""
    )


def run(args: argparse.Namespace) -> int:
    from afd_mrv2.checkpoints.sizing import plan_roles, size_checkpoint

    memory = None if args.device_memory is None else parse_size(args.device_memory)
    sizes = size_checkpoint(args.model)
    params = size_checkpoint(args.model, parameters=True)
    groups(args)  # the layout is checked before any reading
    plans = plan_roles(sizes, args.attention, args.ffn, args.expert_replicas)
    if memory is not None:
        _check_fit(plans, memory)
    print(_as_json(sizes, params, args, plans) if args.json else _text(sizes, params, args, plans))
    return 0
