"""One worker's start-up registrations on vLLM-Ascend, for real, in a fresh process (the CPU vehicle).

Run by ``tests/ascend_vehicle/test_registration.py`` with the vehicle's interpreter and
``PYTHONPATH`` = the NPU stubs (``tests/support/npu_stubs``) and the unpacked vllm-ascend
0.30.0rc2 sdist; prints one JSON line.  ``ORDER`` (argv[1]) is the order of the two steps an
``NPUWorker`` start-up performs:

* ``plugins``: vLLM's own ``load_general_plugins()``, what ``WorkerWrapperBase.init_worker``
  calls before it builds the worker (afd-mrv2's entry point is found through its editable
  install, vllm-ascend's through the sdist's ``vllm_ascend.egg-info``);
* ``ascend``: vllm-ascend's real ``register_ascend_customop(vllm_config)``, what
  ``NPUWorker.__init__`` calls (``vllm_ascend/worker/worker.py``).

``plugins,ascend`` is a worker's real order; ``ascend,plugins`` the opposite one; ``legacy``
replays afd-mrv2 0.2's plugin (an unconditional ``register_routed_experts()``) before
``ascend``: the crash the vehicle keeps as its negative control.  argv[2] is the
``additional_config`` JSON.  The result is vLLM's whole out-of-tree registry (name -> class), the platform
vLLM resolved and, for a failed step, the exception.
"""

from __future__ import annotations

import json
import sys
import traceback


def _step(name: str, vllm_config: object) -> None:
    if name == "plugins":
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    elif name == "legacy":
        from afd_mrv2.mrv2.attention.experts import register_routed_experts

        register_routed_experts()
    else:
        from vllm_ascend.utils import register_ascend_customop

        register_ascend_customop(vllm_config)


def _qualname(cls: type | None) -> str | None:
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"


def main(order: str, additional_config: str) -> dict[str, object]:
    from vllm.config import VllmConfig, set_current_vllm_config

    vllm_config = VllmConfig(additional_config=json.loads(additional_config))
    out: dict[str, object] = {"steps": []}
    with set_current_vllm_config(vllm_config):
        for name in order.split(","):
            try:
                _step(name, vllm_config)
            except BaseException as exc:  # noqa: BLE001 - the vehicle reports what a worker would die of
                out["failed"] = {"step": name, "type": type(exc).__name__, "message": str(exc)}
                out["traceback"] = traceback.format_exc().splitlines()[-12:]
                break
            out["steps"].append(name)  # type: ignore[attr-defined]
    from vllm.model_executor.custom_op import op_registry_oot

    out["registry"] = {key: _qualname(cls) for key, cls in sorted(op_registry_oot.items())}
    from vllm.platforms import current_platform

    out["platform"] = _qualname(type(current_platform))
    return out


if __name__ == "__main__":
    print("VEHICLE " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
