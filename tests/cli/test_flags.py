"""One spelling per concept across the subcommands; each retired spelling still parses, with a deprecation line."""

from __future__ import annotations

import argparse

import pytest

from afd_mrv2.cli import build_parser
from afd_mrv2.cli.serve import options_from_args

SERVE = ["serve", "/models/m", "--attention", "1", "--ffn", "1"]

#: (the arguments with a retired spelling, the same with today's, the value that must match)
RETIRED = [
    (["run", "--depth", "2", "3"], ["run", "--depths", "2", "3"], "depths"),
    (["run", "--stages", "2"], ["run", "--ubatches", "2"], "ubatches"),
    (["run", "--requests-per-stage", "3"], ["run", "--requests-per-ubatch", "3"], "requests_per_ubatch"),
    (["demo", "--depth", "4"], ["demo", "--depths", "4"], "depths"),
    ([*SERVE, "--ready-timeout", "7"], [*SERVE, "--ready-timeout-s", "7"], "ready_timeout_s"),
    ([*SERVE, "--stop-grace", "2"], [*SERVE, "--stop-grace-s", "2"], "stop_grace_s"),
]


def _parse(argv: list[str]) -> object:
    args = build_parser().parse_args(argv)
    if argv[0] == "serve":
        return options_from_args(args)  # serve parses what follows MODEL itself
    return args


@pytest.mark.parametrize(("old", "new", "field"), RETIRED, ids=[o[1] for o, _, _ in RETIRED])
def test_a_retired_spelling_parses_as_todays_with_a_deprecation_line(
    old: list[str], new: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    today = getattr(_parse(new), field)
    assert capsys.readouterr().err == ""
    assert getattr(_parse(old), field) == today is not None
    retired = next(a for a in old if a.startswith("--") and a not in new)
    spelling = next(a for a in new if a.startswith("--") and a not in old)
    assert capsys.readouterr().err == (
        f"afd-mrv2 {old[0]}: warning: {retired} is deprecated since afd-mrv2 0.3.0: use {spelling}\n"
    )


def _options(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ["run", "demo", "bench", "serve", "make-model", "compat", "probe", "plan"])
def test_one_spelling_per_concept(command: str) -> None:
    """Seconds end in ``-s``; a list of depths compared is ``--depths`` and ``--depth`` is serve's one depth;
    micro-batches are ``--ubatches``; retired spellings stay out of the help."""
    options = _options(command)
    shown = {s for s, a in options.items() if a.help != argparse.SUPPRESS}
    for option in shown:
        if any(word in option for word in ("timeout", "grace")):
            assert option.endswith("-s"), option
    assert "--stages" not in shown and "--requests-per-stage" not in shown
    if "--depths" in shown:
        assert options["--depths"].nargs == "+"
    if "--depth" in shown:
        assert command == "serve" and options["--depth"].nargs is None
    hidden = {s for s, a in options.items() if a.help == argparse.SUPPRESS}
    assert hidden <= {"--depth", "--stages", "--requests-per-stage", "--ready-timeout", "--stop-grace"}


def test_the_retired_spellings_are_not_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("run", "demo", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = capsys.readouterr().out
        for retired in ("--stages", "--requests-per-stage", "--ready-timeout ", "--stop-grace "):
            assert retired not in text, (command, retired)
        assert ("--depth " in text) == (command == "serve"), command
