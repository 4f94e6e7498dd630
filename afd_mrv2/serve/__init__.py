"""``afd-mrv2 serve``: A Attention engines and F FFN processes behind one OpenAI-compatible endpoint.

* :mod:`~afd_mrv2.serve.plan`: the command line -> one checked :class:`Plan`
  (per-rank ``afd`` sections, ports, command lines; role commands are data);
* :mod:`~afd_mrv2.serve.roles`: one role process (process group, prefixed log, readiness);
* :mod:`~afd_mrv2.serve.proxy`: the balancing, streaming aiohttp proxy;
* :mod:`~afd_mrv2.serve.supervisor`: start order, the ready line, signals, faults;
* :mod:`~afd_mrv2.serve.app`: :func:`serve`, the checks before anything starts;
* over several machines: :mod:`~.nodes` (layout), :mod:`~.remote` (node 0's view), :mod:`~.agent` (the others).

See docs/serve.md.
"""

from __future__ import annotations

from afd_mrv2.serve.app import PlanGate, prepare, runtime_gate, serve
from afd_mrv2.serve.plan import (
    FFN_READY_MARKER,
    Plan,
    RoleCommands,
    RoleContext,
    ServeOptions,
    attention_command,
    build_plan,
    ffn_command,
)
from afd_mrv2.serve.supervisor import READY_PREFIX

__all__ = [
    "FFN_READY_MARKER",
    "READY_PREFIX",
    "Plan",
    "PlanGate",
    "RoleCommands",
    "RoleContext",
    "ServeOptions",
    "attention_command",
    "build_plan",
    "ffn_command",
    "prepare",
    "runtime_gate",
    "serve",
]
