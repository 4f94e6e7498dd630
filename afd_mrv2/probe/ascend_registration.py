"""One worker's start-up registrations on vLLM-Ascend, for real, in a fresh process; prints one JSON line.

``python -m afd_mrv2.probe.ascend_registration ORDER ADDITIONAL_CONFIG_JSON``: ORDER names the steps,
comma-separated (:data:`STEPS`): ``plugins`` (vLLM's ``load_general_plugins``, as
``WorkerWrapperBase.init_worker`` runs it), ``ascend`` (vllm-ascend's ``register_ascend_customop``, as
``NPUWorker.__init__`` runs it), ``afd`` (the Attention adapter replacing vllm-ascend's
``RoutedExperts``).  The line holds vLLM's whole out-of-tree registry, the platform and, for a failed
step, the exception.  ``afd-mrv2 probe ascend`` runs it on the hardware; the CPU vehicle runs it too.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

PREFIX = "REGISTRATION "
Step = Callable[[Any], None]


def _plugins(vllm_config: Any) -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def _ascend(vllm_config: Any) -> None:
    from vllm_ascend.utils import register_ascend_customop

    register_ascend_customop(vllm_config)


def _afd(vllm_config: Any) -> None:
    from afd_mrv2.mrv2.platforms.ascend.attention import install_attention_layer

    install_attention_layer()


#: step name -> what it runs, given the process's VllmConfig
STEPS: Mapping[str, Step] = {"plugins": _plugins, "ascend": _ascend, "afd": _afd}


def _qualname(cls: object) -> str | None:
    if cls is None:
        return None
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)


def run_steps(order: str, additional_config: str, steps: Mapping[str, Step] = STEPS) -> dict[str, object]:
    """Run ``order``'s steps under a current ``VllmConfig``; what the registry holds afterwards."""
    from vllm.config import VllmConfig, set_current_vllm_config

    vllm_config = VllmConfig(additional_config=json.loads(additional_config))
    done: list[str] = []
    out: dict[str, object] = {"steps": done}
    with set_current_vllm_config(vllm_config):
        for name in order.split(","):
            try:
                steps[name](vllm_config)
            except BaseException as exc:  # noqa: BLE001 - reported: what a worker would die of
                out["failed"] = {"step": name, "type": type(exc).__name__, "message": str(exc)}
                out["traceback"] = traceback.format_exc().splitlines()[-12:]
                break
            done.append(name)
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.platforms import current_platform

    out["registry"] = {key: _qualname(cls) for key, cls in sorted(op_registry_oot.items())}
    routed = op_registry_oot.get("RoutedExperts")
    bases = routed.__mro__[1:3] if isinstance(routed, type) else ()
    out["routed_experts_bases"] = [_qualname(base) for base in bases]
    out["platform"] = _qualname(type(current_platform))
    return out


def parse(stdout: str) -> dict[str, Any] | None:
    """The result line of a child's output, or None when it printed none."""
    for line in stdout.splitlines():
        if line.startswith(PREFIX):
            found: dict[str, Any] = json.loads(line[len(PREFIX) :])
            return found
    return None


if __name__ == "__main__":
    print(PREFIX + json.dumps(run_steps(sys.argv[1], sys.argv[2])), flush=True)
