"""serve's pre-flight child: each role's ``afd`` section against the ``VllmConfig`` its engine arguments make.

``afd-mrv2 serve`` runs ``python -m afd_mrv2.serve.preflight`` (:func:`afd_mrv2.serve.app.runtime_gate`)
before any role starts; it imports vLLM, serve itself does not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Mapping
from typing import Any

from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import AfdError
from afd_mrv2.mrv2.deployment import check_experts, check_vllm_deployment
from afd_mrv2.mrv2.engine_args import FFN_ENGINE_DEFAULTS, engine_config, vllm_engine_kwargs, vllm_serve_parser
from afd_mrv2.serve import options as serve_options
from afd_mrv2.support_matrix import Deployment


def check_serve_arguments(vllm_args: list[str]) -> None:
    """Refuse arguments vLLM's OpenAI server would refuse (unknown ones, bad values), in one line.

    Parsed with vLLM's own server parser (:func:`~afd_mrv2.mrv2.engine_args.vllm_serve_parser`), so the
    FFN role, which takes only engine arguments, never drops one silently that the Attention engine
    then fails on.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            # the engine's own parser first (fast); vLLM's server parser, which imports the whole OpenAI
            # server (seconds), only for what the engine's leaves (front-end arguments, or mistakes), or
            # once per vLLM version to cache every option name for serve's next pre-flights
            engine = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
            _, unknown = engine.parse_known_args(vllm_args)
            cached = serve_options.load() is not None
            if unknown or not cached:
                server = vllm_serve_parser()
                if not cached:
                    serve_options.write(serve_options.parser_options([engine, server]))
                if unknown:
                    _, unknown = server.parse_known_args(vllm_args)
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if line.strip()]
        why = lines[-1].split("error: ", 1)[-1] if lines else "rejected"
        raise AfdError(f"vLLM's argument parser refused the engine arguments: {why}") from None
    if unknown:
        raise serve_options.refusal(unknown)


def check_role_arguments(model: str, section: Mapping[str, Any], vllm_args: list[str]) -> Deployment:
    """Check the ``afd`` ``section`` of one role against the ``VllmConfig`` its engine arguments make.

    ``vllm_args``: the engine arguments in ``vllm serve`` syntax; the FFN role gets
    :data:`~afd_mrv2.mrv2.engine_args.FFN_ENGINE_DEFAULTS` under them, as its process does.
    """
    config = parse_afd_config(section)
    kwargs = vllm_engine_kwargs(vllm_args, prog="afd-mrv2 serve") if vllm_args else {}
    if config.role == "ffn":
        kwargs = {**FFN_ENGINE_DEFAULTS, **kwargs}
    vllm_config = engine_config(model, kwargs, {"afd": dict(section)})
    check_experts(config, vllm_config.model_config)
    return check_vllm_deployment(config, vllm_config)  # the plugins and runtime pair: serve's own gate


def main(argv: list[str] | None = None) -> int:
    """``python -m afd_mrv2.serve.preflight MODEL --out FILE --section JSON [--section JSON] [--attention-arg ARG]
    [-- VLLM ARGS]``.

    What ``afd-mrv2 serve`` runs before it starts any role: each role's ``afd`` section
    (``--section``) against the ``VllmConfig`` the engine arguments make.  Writes
    ``{"refused": LINE}`` (exit 2) for a refused combination, ``{"failed": LINE}``
    (exit 3) when vLLM itself cannot build the config from these arguments, else
    ``{"deployments": {role: {...}}}`` (exit 0).  vLLM's own log goes to this
    process's output, which serve discards.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    head, vllm_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m afd_mrv2.serve.preflight", allow_abbrev=False)
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--section", action="append", default=[], help="one role's afd section (JSON)")
    parser.add_argument(
        "--attention-arg", action="append", default=[], help="an engine argument for the attention role only"
    )
    args = parser.parse_args(head)
    result: dict[str, Any] = {"deployments": {}}
    code = 0
    try:  # first (no config is built for arguments vLLM refuses): what the FFN role would drop, since it
        # takes engine arguments only, but the Attention engine would refuse
        check_serve_arguments(vllm_args)
    except AfdError as exc:
        result, code = {"refused": str(exc)}, 2
    for text in args.section if code == 0 else []:
        section = json.loads(text)
        role = section.get("role")
        try:
            role_args = [*args.attention_arg, *vllm_args] if role == "attention" else vllm_args
            deployment = check_role_arguments(args.model, section, role_args)
        except AfdError as exc:
            result, code = {"refused": f"{exc} (the {role} role's engine arguments)"}, 2
            break
        except Exception as exc:  # noqa: BLE001 - vLLM's own refusal of the arguments, reported as one line
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            why = "; ".join(lines[:2])
            result, code = {"failed": f"vLLM cannot build the {role} role's config: {type(exc).__name__}: {why}"}, 3
            break
        result["deployments"][role] = dict(vars(deployment))
    with open(args.out, "w") as out:
        json.dump(result, out)
    return code


if __name__ == "__main__":
    sys.exit(main())
