"""Start an FFN role process: ``python -m afd_mrv2.mrv2.ffn_role MODEL --afd JSON [--engine-args JSON]``.

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
Attention engine gets.  ``enforce_eager`` defaults to true here: the FFN engine
runs no model forward of its own beyond vLLM's start-up.
Exit status: 0 after a session, 2 for a bad ``--afd`` (one line, nothing started).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from afd_mrv2.errors import AfdError
from afd_mrv2.mrv2.ffn_server import ffn_serving_config

EXTENSION = "afd_mrv2.mrv2.worker_ext.AfdWorkerExtension"


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AfdError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise AfdError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m afd_mrv2.mrv2.ffn_role", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the checkpoint folder (or model name) the Attention engine serves")
    parser.add_argument("--afd", required=True, help='the afd section as JSON, role "ffn"')
    parser.add_argument("--engine-args", default="{}", help="extra LLM(...) keyword arguments as a JSON object")
    args = parser.parse_args(argv)
    try:
        afd = _json_object(args.afd, "--afd")
        ffn_serving_config(afd)  # fail before any engine exists
        engine_args = _json_object(args.engine_args, "--engine-args")
    except AfdError as exc:
        print(f"afd-mrv2 ffn: {exc}", file=sys.stderr)
        return 2
    from vllm import LLM

    engine_args.setdefault("enforce_eager", True)
    llm = LLM(model=args.model, additional_config={"afd": afd}, worker_extension_cls=EXTENSION, **engine_args)
    print(f"afd-mrv2 ffn: ready pid={os.getpid()}", flush=True)
    (report,) = llm.collective_rpc("afd_ffn_serve")
    print(f"afd-mrv2 ffn: done {json.dumps(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
