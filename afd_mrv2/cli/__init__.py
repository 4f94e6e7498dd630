"""The ``afd-mrv2`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` (a function
taking the parsed arguments and returning the exit code).  :func:`add_command`
opens a subcommand's parser the one way every subcommand does.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from afd_mrv2.errors import AfdError

# subcommand -> module; each module's register() adds the parser.
COMMANDS = {
    "demo": "afd_mrv2.cli.demo",
    "run": "afd_mrv2.cli.run",
    "bench": "afd_mrv2.cli.bench",
    "compat": "afd_mrv2.cli.compat",
    "probe": "afd_mrv2.cli.probe",
    "make-model": "afd_mrv2.cli.make_model",
    "serve": "afd_mrv2.cli.serve",
}


def add_command(
    sub: argparse._SubParsersAction, name: str, summary: str, description: str | None = None
) -> argparse.ArgumentParser:
    """Add subcommand ``name``: ``summary`` is its line in ``afd-mrv2 --help``, ``description`` heads its own help."""
    return sub.add_parser(name, help=summary, description=description or summary)


def add_buffer_options(group: argparse._ActionsContainer, *, depth_flag: str, default: str, what: str = "run") -> None:
    """``depth_flag`` (depths d = d input + d output buffers) and ``--buffers IN OUT`` (repeatable)."""
    group.add_argument(
        depth_flag,
        type=int,
        nargs="+",
        default=None,
        help=f"depths to {what}, each d input + d output buffers (default {default}, or none with --buffers)",
    )
    group.add_argument(
        "--buffers",
        type=int,
        nargs=2,
        action="append",
        metavar=("IN", "OUT"),
        default=[],
        help=f"also {what} IN input + OUT output buffers (repeatable: --buffers 2 2 --buffers 3 2)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd-mrv2",
        description="Attention-FFN Disaggregation on one shared multi-stream pipeline.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except AfdError as exc:
        print(f"afd-mrv2 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"afd-mrv2 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
