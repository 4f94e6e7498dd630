"""``afd-mrv2 ffn MODEL [--afd JSON] [--engine-args JSON] [-- VLLM ARGS]``: one FFN rank, for a deployment whose
cluster manager starts each role itself (the Attention engines with ``vllm serve``); see docs/vllm.md.

The same process ``afd-mrv2 serve`` starts for each FFN rank (:mod:`afd_mrv2.mrv2.ffn.role`).
"""

from __future__ import annotations

import argparse

from afd_mrv2.cli import add_command

SUMMARY = "run one FFN rank of an AFD deployment (its Attention engines started with vllm serve)"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        sub,
        "ffn",
        SUMMARY,
        SUMMARY + ". MODEL [--afd JSON] [--engine-args JSON] [-- VLLM ARGS]: the afd section (role ffn, its rank, "
        "the rendezvous store's host and port) comes from --afd or from --additional-config in VLLM ARGS; "
        "prints 'afd-mrv2 ffn: ready' once serving, and its report when its Attention engines are gone.",
    )
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="MODEL [OPTIONS] [-- VLLM ARGS]")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from afd_mrv2.mrv2.ffn import role  # imports the vLLM integration: only when an FFN rank runs

    return role.main(list(args.rest))
