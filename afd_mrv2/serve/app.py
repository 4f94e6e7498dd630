"""``serve()``: check everything, then run the supervisor.

Nothing starts before the plan (the ``afd`` section, ``--depth``, topology,
connector), the runtime gate and the ports passed; each refusal is one
:class:`~afd_mrv2.errors.AfdError` line (the command line turns it into exit 2).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TextIO

from afd_mrv2.compat import check_runtime, v2_runner_selected
from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import AfdError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.serve.plan import Plan, RoleCommands, ServeOptions, build_plan, check_ports_free
from afd_mrv2.serve.supervisor import Supervisor
from afd_mrv2.validation import required_capabilities

#: Decides, before anything starts, whether this runtime may serve ``plan``; raises AfdError if not.
PlanGate = Callable[[Plan], None]


def runtime_gate(plan: Plan) -> None:
    """The gate of the vLLM roles: the ``afd`` section must be one the vLLM MoE seam serves
    (:func:`afd_mrv2.mrv2.remote.check_vllm_path`) and the installed vLLM pair must grant what
    every role's process will require (:func:`afd_mrv2.validation.required_capabilities`, the
    check each process runs itself: ``moe_seam``, ``mrv2`` with the V2 runner,
    ``multistream_ffn`` where multistream is on, the connector's own)."""
    from afd_mrv2.mrv2.remote import check_vllm_path  # a lower layer; imports torch, so only when gating

    attention, ffn = (parse_afd_config({**plan.afd, "role": role}) for role in (ATTENTION, FFN))
    check_vllm_path(attention)
    v2 = v2_runner_selected()
    require = {cap for config in (attention, ffn) for cap in required_capabilities(config, v2_runner=v2)}
    decision = check_runtime(tuple(sorted(require)))
    if not decision.accepted:
        reasons = "; ".join(decision.reasons) or "refused"
        raise AfdError(f"runtime refused: {reasons} (afd-mrv2 compat lists the accepted pairs)")


def prepare(opts: ServeOptions, *, commands: RoleCommands | None = None, gate: PlanGate | None = runtime_gate) -> Plan:
    """Every check that runs before a process starts: plan, runtime gate (None skips it), ports."""
    plan = build_plan(opts, commands)
    if gate is not None:
        gate(plan)
    check_ports_free([p for r in plan.roles if (p := r.port) is not None] + [int(plan.afd["port"])])
    return plan


def serve(
    opts: ServeOptions,
    *,
    commands: RoleCommands | None = None,
    gate: PlanGate | None = runtime_gate,
    out: TextIO | None = None,
    log: TextIO | None = None,
) -> int:
    """Run ``afd-mrv2 serve`` until a signal or a role's death; returns the exit code (AfdError: refused up front)."""
    plan = prepare(opts, commands=commands, gate=gate)
    return asyncio.run(Supervisor(plan, out=out or sys.stdout, log=log or sys.stderr).run())
