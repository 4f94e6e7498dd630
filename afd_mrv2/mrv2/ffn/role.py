"""Start an FFN role process: ``python -m afd_mrv2.mrv2.ffn.role MODEL [--afd JSON] [--engine-args JSON] [-- VLLM ARGS]``.

Builds a vLLM engine (offline ``LLM``) on MODEL with ``additional_config={"afd":
AFD}`` (role ``ffn``) and afd-mrv2's worker extension, so vLLM loads the
checkpoint the normal way; then asks the worker, through ``collective_rpc``, to
serve the routed experts (:meth:`AfdWorkerExtension.afd_ffn_serve`) until the
Attention role leaves.

Start it BEFORE the Attention engine: the Attention engine's warm-up forward
already reaches the FFN (docs/vllm.md).  Output, one line each on stdout::

    afd-mrv2 ffn: ready pid=<pid>            the engine is built; the worker opens the link next
    afd-mrv2 ffn: done {...}                 the session's report (JSON), when the Attention role left

``--engine-args`` is a JSON object of extra ``LLM(...)`` keyword arguments
(``dtype``, ``max_model_len``, ``max_num_batched_tokens``, ...), the same the
Attention engine gets.  VLLM ARGS after ``--`` are vLLM engine arguments as
``vllm serve`` takes them (``--dtype float32 --max-model-len 256 ...``, what
``afd-mrv2 serve`` passes every role), parsed by vLLM's own parser
(``EngineArgs.add_cli_args``); the ones given explicitly become ``LLM(...)``
keyword arguments under ``--engine-args``; arguments that are not engine
arguments (front-end ones such as ``--api-key``) are ignored with a line on
stderr.  The ``afd`` section is ``--afd``, else the ``afd`` key of an
``--additional-config`` among VLLM ARGS (whose other keys are kept).
``enforce_eager`` defaults to true here: the FFN engine runs no model forward
of its own beyond vLLM's start-up.  Before it builds the engine, the ``VllmConfig``
these arguments make is admitted (:func:`afd_mrv2.mrv2.deployment.admit`: section,
plugins, runtime pair, routed experts that shard over the FFN ranks, support matrix).
Exit status: 0 after a session, 2 for a bad ``--afd`` or VLLM ARGS or an
unsupported combination (one line, nothing started).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from afd_mrv2.errors import AfdError
from afd_mrv2.mrv2 import WORKER_EXTENSION
from afd_mrv2.mrv2.deployment import admit
from afd_mrv2.mrv2.engine_args import FFN_ENGINE_DEFAULTS, engine_config, vllm_engine_kwargs
from afd_mrv2.mrv2.ffn.leader import LEADER_KEY
from afd_mrv2.mrv2.ffn.server import ffn_serving_config
from afd_mrv2.options import json_object

__all__ = ["main", "vllm_engine_kwargs"]


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
            additional["afd"] = json_object(args.afd, "--afd")
        if not isinstance(additional.get("afd"), dict):
            raise AfdError("--afd: the afd section is required (--afd JSON or --additional-config in VLLM ARGS)")
        ffn_serving_config(additional["afd"])  # fail before any engine exists (the FFN role's own checks)
        other = engine_args.pop("worker_extension_cls", WORKER_EXTENSION)
        if other != WORKER_EXTENSION:
            raise AfdError(f"--worker-extension-cls: the FFN role needs {WORKER_EXTENSION}, got {other}")
        engine_args = {**FFN_ENGINE_DEFAULTS, **engine_args}
        engine_args.pop("model", None)
        # the support matrix on the VllmConfig these arguments make, before the engine (and any link) exists
        admit(engine_config(args.model, engine_args, additional), model=True)  # the one admission call
    except AfdError as exc:
        print(f"afd-mrv2 ffn: {exc}", file=sys.stderr)
        return 2
    from vllm import LLM

    additional[LEADER_KEY] = os.getpid()  # the serving worker ends with this process (mrv2.leader)
    llm = LLM(model=args.model, additional_config=additional, worker_extension_cls=WORKER_EXTENSION, **engine_args)
    print(f"afd-mrv2 ffn: ready pid={os.getpid()}", flush=True)
    (report,) = llm.collective_rpc("afd_ffn_serve")
    print(f"afd-mrv2 ffn: done {json.dumps(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
