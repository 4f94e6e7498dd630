"""``afd-mrv2 serve MODEL --attention A --ffn F [--attention-groups G] [--attention-tp T] [--port PORT] [--nnodes N --node-rank K --master-addr ADDR] [--expert-replicas R] [--ubatches N] [--depth D|auto] [--connector NAME] [--ready-timeout-s S] [--stop-grace-s S] [-- EXTRA VLLM ARGS]``.

Starts F FFN role processes and A independent vLLM Attention engines (DP=1,
each on its own port) and serves one OpenAI-compatible endpoint in front of
them.  See docs/serve.md and :mod:`afd_mrv2.serve`.

Everything after ``--`` goes to every role's command line; an
``--additional-config JSON`` there is merged into each role's own config (its
``afd`` section under ``--afd`` and the flags).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from afd_mrv2.cli import add_command, add_retired_spelling
from afd_mrv2.config import TRANSPORTS
from afd_mrv2.errors import AfdError
from afd_mrv2.ports import HOST
from afd_mrv2.serve import RoleCommands, ServeOptions, runtime_gate, serve
from afd_mrv2.serve.app import PlanGate
from afd_mrv2.serve.nodes import NodeOptions
from afd_mrv2.serve.plan import DEFAULT_CONNECTOR, DEFAULT_PORT
from afd_mrv2.serve.proxy import BALANCE

SUMMARY = "serve a model with AFD: A vLLM Attention engines + F FFN processes behind one OpenAI endpoint"


class _OneLineParser(argparse.ArgumentParser):
    """Parses what follows MODEL; a bad option is one AfdError line (exit 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        raise AfdError(message)


def _add_options(parser: argparse.ArgumentParser) -> None:
    _add_topology_options(parser)
    _add_node_options(parser)
    _add_afd_options(parser)
    _add_endpoint_options(parser)


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    """One deployment over several machines: the same command on each, with its node rank (docs/serve.md)."""
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="machines the deployment spans (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="K", help="this machine's rank, 0..N-1 (default 0)")
    parser.add_argument(
        "--master-addr", metavar="ADDR", help="node 0's address: the rendezvous store listens there (needed with N > 1)"
    )
    parser.add_argument("--master-port", type=int, metavar="P", help="the rendezvous store's port (default: PORT+A+1)")
    parser.add_argument(
        "--node-addr",
        metavar="ADDR",
        help="the address this node's roles bind and advertise (default: this host's address on the route to "
        "--master-addr)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="FILE",
        help="the deployment's secret (at least 16 bytes), the same file on every node; needed with N > 1 "
        "(default on one node: a fresh one); guards the rendezvous store and the pairs",
    )
    parser.add_argument(
        "--layout",
        metavar="a0=0,f1=1",
        help="move role ranks to other nodes than the default (each role's ranks in blocks over the nodes)",
    )


def _add_topology_options(parser: argparse.ArgumentParser) -> None:
    """The roles, their ports, replicas and restarts."""
    parser.add_argument(
        "--attention",
        type=int,
        metavar="A",
        help="Attention data-parallel ranks: the DP ranks of one vLLM deployment (vLLM's own DP engine cores, "
        "front end and balancing; an FFN rank computes each layer once for all of them)",
    )
    parser.add_argument(
        "--attention-groups",
        type=int,
        default=1,
        metavar="G",
        help="split the A ranks into G independent vLLM deployments of A/G DP ranks each, behind serve's endpoint "
        "(G = A: independent engines; a group's loss leaves the others serving; default %(default)s)",
    )
    parser.add_argument(
        "--attention-tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel ranks of each Attention DP rank (each sends its share of the tokens; default %(default)s)",
    )
    parser.add_argument(
        "--ffn", type=int, metavar="F", help="FFN ranks (any number >= 1): experts are sharded over them"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="the endpoint's port (node 0); Attention group i listens on PORT+1+i of its node (default %(default)s)",
    )
    parser.add_argument("--host", default=HOST, help="the address the endpoint binds (default %(default)s)")
    parser.add_argument(
        "--expert-replicas",
        type=int,
        metavar="R",
        help="keep every routed expert on R FFN ranks (1..F, default 1): with R >= 2 the loss of an FFN rank is "
        "survived, its experts served by their other holders (afd.expert_replicas)",
    )
    parser.add_argument(
        "--no-restart-ffn",
        action="store_true",
        help="with --expert-replicas >= 2: leave a lost FFN rank lost instead of restarting it (serve runs degraded)",
    )
    parser.add_argument(
        "--no-restart-attention",
        action="store_true",
        help="with --attention-groups >= 2: leave a lost Attention group lost instead of restarting it",
    )


def _add_afd_options(parser: argparse.ArgumentParser) -> None:
    """The flags that become keys of every role's afd section."""
    parser.add_argument(
        "--ubatches",
        type=int,
        metavar="N",
        help="split each Attention engine step into N micro-batches (2..4) so one micro-batch's FFN round trip "
        "runs under another's attention: afd.ubatch.num_ubatches, on vLLM's Model Runner V2 (serve selects it "
        "and afd-mrv2's worker for the Attention engines, eager; N=1: the same, unsplit); without the flag every "
        "MoE layer is one blocking round trip on vLLM's own runner choice",
    )
    parser.add_argument("--depth", metavar="D|auto", help="run the FFN side multistream with this depth (1..8 or auto)")
    parser.add_argument("--connector", metavar="NAME", help=f"afd.connector (default {DEFAULT_CONNECTOR})")
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="what torch_p2p's pairs run on: afd.transport (default tcp: a TCP connection per pair; zmq: ZeroMQ "
        "sockets; gloo: a gloo group per pair; see docs/config.md)",
    )
    parser.add_argument("--afd", metavar="JSON", help="a base afd section (JSON object) under the flags above")


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    """How the endpoint balances, and how long serve waits for the roles to start and to stop."""
    parser.add_argument(
        "--balance", choices=BALANCE, default=BALANCE[0], help="how the endpoint picks an engine (default %(default)s)"
    )
    ready = parser.add_argument(
        "--ready-timeout-s",
        type=float,
        default=900.0,
        metavar="S",
        help="seconds for every role to get ready (default %(default)s)",
    )
    add_retired_spelling(parser, "--ready-timeout", ready)
    grace = parser.add_argument(
        "--stop-grace-s",
        type=float,
        default=5.0,
        metavar="S",
        help="SIGTERM-to-SIGKILL grace, seconds (default %(default)s)",
    )
    add_retired_spelling(parser, "--stop-grace", grace)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        sub,
        "serve",
        SUMMARY,
        SUMMARY + ". Everything after -- goes to every role (vLLM engine arguments). "
        "Prints 'afd-mrv2 serve: ready at http://HOST:PORT/v1' once when every role is ready (on node 0).",
    )
    _add_options(parser)
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="MODEL [OPTIONS] [-- EXTRA VLLM ARGS]")
    parser.set_defaults(handler=run)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """MODEL, the options after it and the EXTRA VLLM ARGS after ``--`` (argparse alone cannot split them)."""
    rest = list(args.rest)
    head, extra = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    inner = _OneLineParser(prog="afd-mrv2 serve", add_help=False)
    inner.add_argument("model")
    _add_options(inner)
    if not head:
        raise AfdError("the MODEL argument is required (a model directory or name)")
    inner.parse_args(head, namespace=args)
    for flag in ("attention", "ffn"):
        if getattr(args, flag) is None:
            raise AfdError(f"--{flag} is required")
    return ServeOptions(
        model=args.model,
        attention=args.attention,
        attention_groups=args.attention_groups,
        attention_tp=args.attention_tp,
        ffn=args.ffn,
        port=args.port,
        depth=args.depth,
        ubatches=args.ubatches,
        expert_replicas=args.expert_replicas,
        restart_ffn=not args.no_restart_ffn,
        restart_attention=not args.no_restart_attention,
        connector=args.connector,
        transport=args.transport,
        afd_json=args.afd,
        extra=tuple(extra),
        balance=args.balance,
        ready_timeout_s=args.ready_timeout_s,
        stop_grace_s=args.stop_grace_s,
        nodes=NodeOptions(
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            node_addr=args.node_addr,
            layout=args.layout,
        ),
        host=args.host,
        secret_file=args.secret_file,
    )


def run(args: argparse.Namespace, *, commands: RoleCommands | None = None, gate: PlanGate | None = runtime_gate) -> int:
    opts = options_from_args(args)
    code = serve(opts, commands=commands, gate=gate)
    if opts.nodes.multi:
        # Every role is stopped and the last line written.  Over several nodes a store call may still be blocked
        # on a cut link (a daemon thread inside torch's TCPStore); the interpreter's finalization would wait on
        # that store's lock for as long as the cut lasts, so end here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str], *, commands: RoleCommands | None = None, gate: PlanGate | None = runtime_gate) -> int:
    """``afd-mrv2 serve ARGV`` with other role commands or runtime gate (what the tests start)."""
    parser = argparse.ArgumentParser(prog="afd-mrv2")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *argv])
    try:
        return run(args, commands=commands, gate=gate)
    except AfdError as exc:
        print(f"afd-mrv2 serve: error: {exc}", file=sys.stderr)
        return 2
