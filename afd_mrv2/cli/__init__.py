"""The ``afd-mrv2`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` (a function
taking the parsed arguments and returning the exit code).  :func:`add_command`
opens a subcommand's parser the one way every subcommand does.

One spelling per concept across subcommands: ``--depths`` for the depths a run
compares, ``--depth`` for the one depth serve runs, ``--ubatches`` for micro-batches,
``*-timeout-s`` / ``*-grace-s`` for seconds.  A retired spelling still parses
(:func:`add_retired_spelling`), after a deprecation line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from afd_mrv2.errors import AfdError

#: The release whose command line retired the spellings :func:`add_retired_spelling` keeps.
RETIRED_IN = "0.3.0"

# subcommand -> module; each module's register() adds the parser.
COMMANDS = {
    "demo": "afd_mrv2.cli.demo",
    "run": "afd_mrv2.cli.run",
    "bench": "afd_mrv2.cli.bench",
    "compat": "afd_mrv2.cli.compat",
    "probe": "afd_mrv2.cli.probe",
    "make-model": "afd_mrv2.cli.make_model",
    "plan": "afd_mrv2.cli.plan",
    "serve": "afd_mrv2.cli.serve",
    "ffn": "afd_mrv2.cli.ffn",
}


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, description: str | None = None
) -> argparse.ArgumentParser:
    """Add subcommand ``name``: ``summary`` is its line in ``afd-mrv2 --help``, ``description`` heads its own help."""
    return sub.add_parser(name, help=summary, description=description or summary)


class _RetiredSpelling(argparse.Action):
    """A retired spelling of an option: prints one deprecation line on stderr, then stores as the option does."""

    def __init__(self, option_strings: list[str], dest: str, *, spelling: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.spelling = spelling

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated since afd-mrv2 {RETIRED_IN}: use {self.spelling}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_retired_spelling(group: argparse._ActionsContainer, old: str, option: argparse.Action) -> None:
    """Keep ``old`` parsing as ``option`` (same value, same destination), hidden from the help, with a
    deprecation line on stderr each time it is used."""
    converts: dict[str, Any] = {} if option.type is None else {"type": option.type}
    group.add_argument(
        old,
        action=_RetiredSpelling,
        spelling=option.option_strings[0],
        dest=option.dest,
        **converts,
        nargs=option.nargs,
        choices=option.choices,
        metavar=option.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


def add_buffer_options(
    group: argparse._ActionsContainer, *, default: str, what: str = "run", retired: tuple[str, ...] = ()
) -> None:
    """``--depths D [D ...]`` (each d input + d output buffers) and ``--buffers IN OUT`` (repeatable);
    ``retired``: old spellings of ``--depths`` still accepted (:func:`add_retired_spelling`)."""
    depths = group.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=None,
        metavar="D",
        help=f"depths to {what}, each d input + d output buffers (default {default}, or none with --buffers)",
    )
    for old in retired:
        add_retired_spelling(group, old, depths)
    group.add_argument(
        "--buffers",
        type=int,
        nargs=2,
        action="append",
        metavar=("IN", "OUT"),
        default=[],
        help=f"also {what} IN input + OUT output buffers (repeatable: --buffers 2 2 --buffers 3 2)",
    )


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line; with ``only`` (a command name) just that command's parser is built, so that running
    one command imports only its module (``compat`` and ``serve`` import no torch)."""
    parser = argparse.ArgumentParser(
        prog="afd-mrv2",
        description="Attention-FFN Disaggregation on one shared multi-stream pipeline.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).register(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The command ``argv`` runs, when its first word names one (else the whole parser decides: help, errors)."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_command(argv)).parse_args(argv)
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
