"""``serve()``: check everything, then run the supervisor.

Nothing starts before the plan (the ``afd`` section, ``--depth``, topology,
connector), the runtime gate and the ports passed; each refusal is one
:class:`~afd_mrv2.errors.AfdError` line (the command line turns it into exit 2).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from afd_mrv2.compat import check_runtime, v2_runner_selected
from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import AfdError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2.deployment import CheckpointExperts, precheck_experts
from afd_mrv2.plugins import check_plugins
from afd_mrv2.serve import options as serve_options
from afd_mrv2.serve.plan import (
    CPU_BIND_ENV,
    EAGER_FLAG,
    Plan,
    RoleCommands,
    ServeOptions,
    build_plan,
    check_model_folder,
    split_additional_config,
)
from afd_mrv2.serve.ports import check_ports_free
from afd_mrv2.serve.supervisor import Supervisor
from afd_mrv2.validation import required_capabilities

#: Decides, before anything starts, whether this runtime may serve ``plan``; raises AfdError if not.
PlanGate = Callable[[Plan], None]


#: The check of the support matrix on each role's ``VllmConfig`` (:mod:`afd_mrv2.mrv2.deployment`).
DEPLOYMENT_CHECK = (sys.executable, "-m", "afd_mrv2.serve.preflight")
DEPLOYMENT_CHECK_TIMEOUT_S = 300.0


class DeploymentCheck:
    """The support matrix on the ``VllmConfig`` each role's engine arguments make, run in a child while serve
    does its own checks (:meth:`start`), answered by :meth:`result`.

    Runs ``python -m afd_mrv2.serve.preflight`` once for both roles (rank 0 of each; the
    ranks of a role differ only in ``afd.rank``), in a child with the roles' environment:
    building a ``VllmConfig`` imports vLLM, which logs to stdout and adjusts its
    process's environment, neither of which serve's own process may get.  The child
    also checks the model's routed experts against the FFN ranks and the arguments after
    ``--`` with vLLM's own parser.
    """

    def __init__(self, plan: Plan, *, timeout_s: float = DEPLOYMENT_CHECK_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        _, extra = split_additional_config(plan.options.extra)
        sections = [json.dumps(dict(plan.of(role)[0].afd), sort_keys=True) for role in (ATTENTION, FFN)]
        attention = plan.of(ATTENTION)[0]
        # the Attention engine's runner choice (V2 for micro-batching) decides what its config says; the extra
        # engine arguments serve adds for it (worker, eager) too; the FFN role's check reads neither
        role_env = {k: v for k, v in attention.env.items() if k != CPU_BIND_ENV}
        attention_args = [EAGER_FLAG] if plan.options.ubatches is not None and EAGER_FLAG not in extra else []
        self._folder = tempfile.TemporaryDirectory(prefix="afd-mrv2-serve-check-")
        self._out = Path(self._folder.name) / "deployment.json"
        cmd = [*DEPLOYMENT_CHECK, plan.options.model, "--out", str(self._out)]
        for section in sections:
            cmd += ["--section", section]
        cmd += [f"--attention-arg={arg}" for arg in attention_args]  # "=": the value starts with "--"
        self._proc = subprocess.Popen(
            [*cmd, "--", *extra],
            env={**role_env, **os.environ},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(self) -> None:
        """Wait for the child; raise :class:`AfdError` with its refusal's one line."""
        try:
            try:
                _, stderr = self._proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.communicate()
                raise AfdError(
                    f"the support-matrix check of the roles' vLLM configs took over {self.timeout_s:.0f} s"
                ) from None
            if not self._out.is_file():
                tail = (stderr.strip().splitlines() or ["no output"])[-1]
                raise AfdError(
                    f"the support-matrix check of the roles' vLLM configs failed (exit {self._proc.returncode}): {tail}"
                )
            result = json.loads(self._out.read_text())
        finally:
            self._folder.cleanup()
        problem = result.get("refused") or result.get("failed")
        if problem:
            raise AfdError(problem)

    def cancel(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.communicate()
        self._folder.cleanup()


def check_deployments(plan: Plan, *, timeout_s: float = DEPLOYMENT_CHECK_TIMEOUT_S) -> None:
    """:class:`DeploymentCheck`, started and answered at once."""
    DeploymentCheck(plan, timeout_s=timeout_s).result()


def runtime_gate(plan: Plan) -> None:
    """:func:`begin_runtime_gate`, then its answer at once."""
    begin_runtime_gate(plan).finish()


class PendingGate:
    """A begun runtime gate: :meth:`finish` completes it (raising its refusal), :meth:`cancel` abandons it."""

    def __init__(self, finish: Callable[[], None], child: DeploymentCheck) -> None:
        self.finish = finish
        self.cancel = child.cancel


def begin_runtime_gate(plan: Plan) -> PendingGate:
    """Start the gate of the vLLM roles; :meth:`PendingGate.finish` completes it.

    The model folder is checked at once and the deployment check's child started (it imports vLLM for
    seconds); the rest runs in the returned call, so serve's own checks overlap the child.

    The gate: the model folder exists; the ``afd`` section must be one the vLLM MoE seam serves
    (:func:`afd_mrv2.mrv2.attention.remote.check_vllm_path`), the installed vLLM pair must grant what
    every role's process will require (:func:`afd_mrv2.validation.required_capabilities`, the
    check each process runs itself: ``moe_seam``, ``mrv2`` with the V2 runner,
    ``multistream_ffn`` where multistream is on, the connector's own), and the support
    matrix must accept each role's real ``VllmConfig`` (:func:`check_deployments`)."""
    check_model_folder(plan.options.model)  # before the seconds vLLM's import and config take
    precheck_experts(parse_afd_config({**plan.afd, "role": FFN}), plan.options.model)  # config.json, no vLLM
    child = DeploymentCheck(plan)

    def finish() -> None:
        from afd_mrv2.mrv2.attention.remote import check_vllm_path  # a lower layer; imports torch, so only when gating

        try:
            attention, ffn = (parse_afd_config({**plan.afd, "role": role}) for role in (ATTENTION, FFN))
            check_vllm_path(attention)
            v2 = v2_runner_selected()
            require = set(required_capabilities(attention, v2_runner=v2 or plan.options.ubatches is not None))
            require |= set(required_capabilities(ffn, v2_runner=v2))
            decision = check_runtime(tuple(sorted(require)))
            if not decision.accepted:
                reasons = "; ".join(decision.reasons) or "refused"
                raise AfdError(f"runtime refused: {reasons} (afd-mrv2 compat lists the accepted pairs)")
        except BaseException:
            child.cancel()
            raise
        child.result()

    return PendingGate(finish, child)


def check_option_names(plan: Plan) -> None:
    """Refuse an argument after ``--`` that is no option of vLLM's OpenAI server, from the option names
    cached by an earlier pre-flight with this vLLM (:mod:`afd_mrv2.serve.options`; nothing is
    imported); without a cache, or for what it cannot judge, vLLM's own parser decides in the child."""
    options = serve_options.load()
    if options is None:
        return
    _, extra = split_additional_config(plan.options.extra)
    bad = serve_options.unknown(extra, options)
    if bad:
        raise serve_options.refusal(bad)


def prepare(opts: ServeOptions, *, commands: RoleCommands | None = None, gate: PlanGate | None = runtime_gate) -> Plan:
    """Every check that runs before a process starts: plan, runtime gate (None skips it), ports."""
    plan = build_plan(opts, commands)
    check_option_names(plan)
    # the real gate starts its vLLM child first, so that the checks here overlap it
    pending = begin_runtime_gate(plan) if gate is runtime_gate else None
    try:
        # the plugins every role will load: installed, of the right kind, of a hook API version served here
        check_plugins(parse_afd_config({**plan.afd, "role": ATTENTION}))
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    if pending is not None:
        pending.finish()
    elif gate is not None:
        gate(plan)
    check_ports_free(plan.role_ports)
    facts = CheckpointExperts.read(opts.model)
    return replace(plan, num_experts=facts.get_num_experts() if facts is not None else None)


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
