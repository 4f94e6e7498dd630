"""Start an FFN role process: ``python -m afd_mrv2.mrv2.ffn.role MODEL [--afd JSON] [--engine-args JSON] [-- VLLM ARGS]``.

Start it before the Attention engine (docs/vllm.md).

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.ffn.role".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from afd_mrv2 import envs
from afd_mrv2.admission import AFD_KEY, LEADER_KEY, own_keys, place_own_keys
from afd_mrv2.compat.detect import replaces_routed_experts
from afd_mrv2.errors import AfdError
from afd_mrv2.mrv2 import WORKER_EXTENSION
from afd_mrv2.mrv2.deployment import admit
from afd_mrv2.mrv2.engine_args import engine_config, ffn_engine_defaults, vllm_engine_kwargs
from afd_mrv2.mrv2.ffn.server import ffn_serving_config
from afd_mrv2.options import json_object

__all__ = ["main", "vllm_engine_kwargs"]


def _engine_additional_config(additional: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The engine's ``additional_config``; afd-mrv2's ``own`` keys go into it, or, on a platform whose
    ``additional_config`` refuses them (vLLM-Ascend), into this process's ``$AFD_MRV2_ADDITIONAL_CONFIG``,
    which the engine's processes inherit (:func:`afd_mrv2.admission.place_own_keys`)."""
    config, env = place_own_keys(additional, own)
    os.environ.update(env)
    return config


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    head, vllm_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m afd_mrv2.mrv2.ffn.role", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("model", help="the checkpoint folder (or model name) the Attention engine serves")
    parser.add_argument("--afd", help='the afd section as JSON, role "ffn" (default: the one in VLLM ARGS)')
    parser.add_argument("--engine-args", default="{}", help="extra LLM(...) keyword arguments as a JSON object")
    args = parser.parse_args(head)
    try:
        engine_args = vllm_engine_kwargs(vllm_args) if vllm_args else {}
        engine_args.update(json_object(args.engine_args, "--engine-args"))
        additional = dict(engine_args.pop("additional_config", None) or {})
        if args.afd is not None:
            additional[AFD_KEY] = json_object(args.afd, "--afd")
        own = own_keys(additional)  # additional_config's, and $AFD_MRV2_ADDITIONAL_CONFIG's (serve's on Ascend)
        if not isinstance(own.get(AFD_KEY), dict):
            raise AfdError(
                "--afd: the afd section is required (--afd JSON, --additional-config in VLLM ARGS, "
                f"or ${envs.ADDITIONAL_CONFIG.name})"
            )
        ffn_serving_config(own[AFD_KEY])  # fail before any engine exists (the FFN role's own checks)
        other = engine_args.pop("worker_extension_cls", WORKER_EXTENSION)
        if other != WORKER_EXTENSION:
            raise AfdError(f"--worker-extension-cls: the FFN role needs {WORKER_EXTENSION}, got {other}")
        engine_args = {**ffn_engine_defaults(experts_only=replaces_routed_experts()), **engine_args}
        engine_args.pop("model", None)
        # the support matrix on the VllmConfig these arguments make, before the engine (and any link) exists
        config = engine_config(args.model, engine_args, _engine_additional_config(additional, own))
        admit(config, model=True)  # the one admission call
    except AfdError as exc:
        print(f"afd-mrv2 ffn: {exc}", file=sys.stderr)
        return 2
    from vllm import LLM

    own[LEADER_KEY] = os.getpid()  # the serving worker ends with this process (mrv2.leader)
    additional = _engine_additional_config(additional, own)
    llm = LLM(model=args.model, additional_config=additional, worker_extension_cls=WORKER_EXTENSION, **engine_args)
    print(f"afd-mrv2 ffn: ready pid={os.getpid()}", flush=True)
    (report,) = llm.collective_rpc("afd_ffn_serve")
    print(f"afd-mrv2 ffn: done {json.dumps(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
