"""serve's pre-flight child: the admission checks that need vLLM, for each role's ``afd`` section.

``afd-mrv2 serve`` runs ``python -m afd_mrv2.serve.preflight`` (:func:`afd_mrv2.serve.app.runtime_gate`)
before any role starts; it imports vLLM, serve itself does not.  For each role: the ``VLLM_CONFIG``
checks on the ``VllmConfig`` its engine arguments make, then the ``MODEL`` checks on the layers vLLM
builds of the model, on the meta device (:func:`afd_mrv2.mrv2.deployment.built_model_facts`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from afd_mrv2 import envs
from afd_mrv2.admission import AFD_KEY, ModelFacts, Stage, Subject, place_own_keys, run
from afd_mrv2.compat.detect import replaces_routed_experts
from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import AfdError
from afd_mrv2.items import FFN
from afd_mrv2.mrv2.deployment import LAYOUT_ARGS, built_model_facts, deployment_of, model_facts
from afd_mrv2.mrv2.engine_args import (
    FFN_EXPERTS_ONLY_DEFAULTS,
    engine_config,
    ffn_engine_defaults,
    vllm_engine_kwargs,
    vllm_serve_parser,
)
from afd_mrv2.serve import options as serve_options
from afd_mrv2.support_matrix import Deployment

log = logging.getLogger(__name__)

#: What this child adds to serve's own checks (``CONFIG``, ``RUNTIME``; :func:`afd_mrv2.serve.app.prepare`).
CHILD_STAGES = (Stage.VLLM_CONFIG, Stage.MODEL)


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


class ModelLayers:
    """The model's MoE layers, built once on the meta device for every role (the roles share one model).

    Built from the first role's engine arguments less the process layout (:data:`LAYOUT_ARGS`) and the FFN
    role's own defaults (its experts-only model), without an ``afd`` section; where vLLM cannot build it so (an architecture whose constructors need a device),
    the routed-expert count of the model's config decides, as every role's own check does.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.facts: ModelFacts | None = None
        self._first: tuple[Mapping[str, Any], Any] | None = None

    def remember(self, kwargs: Mapping[str, Any], vllm_config: Any) -> None:
        """A role's engine arguments and ``VllmConfig`` (the first role's build the layers)."""
        if self._first is None:
            self._first = (kwargs, vllm_config)

    def read(self) -> ModelFacts | None:
        """The facts (built on first use); None before any role's config was built."""
        if self.facts is None and self._first is not None:
            kwargs, vllm_config = self._first
            structure = {  # the checkpoint's own model: not the FFN role's experts-only one, nor its load format
                k: v
                for k, v in kwargs.items()
                if k not in LAYOUT_ARGS and not (k in FFN_EXPERTS_ONLY_DEFAULTS and FFN_EXPERTS_ONLY_DEFAULTS[k] == v)
            }
            try:
                self.facts = built_model_facts(engine_config(self.model, structure, {}))
            except Exception as exc:  # noqa: BLE001 - a model vLLM cannot build on the meta device: its config decides
                log.warning("afd-mrv2: the model's layers could not be built on the meta device (%s)", exc)
                self.facts = model_facts(vllm_config.model_config)
        return self.facts


@contextlib.contextmanager
def own_keys_of(section: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The ``additional_config`` a role's engine gets with ``section``, and meanwhile this process's
    ``$AFD_MRV2_ADDITIONAL_CONFIG`` as that role's process has it (set on vLLM-Ascend, unset elsewhere:
    :func:`~afd_mrv2.admission.place_own_keys`), whatever the variable held before (another role's section)."""
    name = envs.ADDITIONAL_CONFIG.name
    additional_config, env = place_own_keys({}, {AFD_KEY: dict(section)})
    saved = os.environ.pop(name, None)
    os.environ.update(env)
    try:
        yield additional_config
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def check_role_arguments(
    model: str, section: Mapping[str, Any], vllm_args: list[str], layers: ModelLayers
) -> Deployment:
    """The ``VLLM_CONFIG`` admission checks of one role's ``afd`` ``section`` on the ``VllmConfig`` its engine
    arguments make; ``layers`` remembers them for the ``MODEL`` checks (:func:`check_model`).

    ``vllm_args``: the engine arguments in ``vllm serve`` syntax; the FFN role gets
    :func:`~afd_mrv2.mrv2.engine_args.ffn_engine_defaults` under them, as its process does.
    """
    config = parse_afd_config(section)
    kwargs = vllm_engine_kwargs(vllm_args, prog="afd-mrv2 serve") if vllm_args else {}
    if config.role == FFN:
        kwargs = {**ffn_engine_defaults(experts_only=replaces_routed_experts()), **kwargs}
    with own_keys_of(section) as additional_config:
        vllm_config = engine_config(model, kwargs, additional_config)
        deployment = deployment_of(vllm_config)
    run(Subject(config, deployment=deployment), (Stage.VLLM_CONFIG,))
    layers.remember(kwargs, vllm_config)
    return deployment


def check_model(section: Mapping[str, Any], layers: ModelLayers) -> None:
    """The ``MODEL`` admission checks (once: the roles share the model and ``afd.num_ffn_ranks``) on the layers
    vLLM builds of it."""
    run(Subject(section, model=layers.read), (Stage.MODEL,))


def _check_roles(
    model: str, sections: list[Mapping[str, Any]], args: argparse.Namespace, vllm_args: list[str]
) -> dict[str, Any]:
    """Every role's checks, then the model's; the result :func:`main` writes."""
    result: dict[str, Any] = {"deployments": {}}
    layers = ModelLayers(model)
    for section in sections:
        role = section.get("role")
        try:
            role_args = [*args.attention_arg, *vllm_args] if role == "attention" else vllm_args
            deployment = check_role_arguments(model, section, role_args, layers)
        except AfdError as exc:
            return {"refused": f"{exc} (the {role} role's engine arguments)"}
        except Exception as exc:  # noqa: BLE001 - vLLM's own refusal of the arguments, reported as one line
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            why = "; ".join(lines[:2])
            return {"failed": f"vLLM cannot build the {role} role's config: {type(exc).__name__}: {why}"}
        result["deployments"][role] = dict(vars(deployment))
    try:
        if sections:
            check_model(sections[-1], layers)
    except AfdError as exc:
        return {"refused": str(exc), "model": dataclasses.asdict(layers.facts) if layers.facts else None}
    if layers.facts is not None:
        result["model"] = dataclasses.asdict(layers.facts)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m afd_mrv2.serve.preflight MODEL --out FILE --section JSON [--section JSON] [--attention-arg ARG]
    [-- VLLM ARGS]``.

    What ``afd-mrv2 serve`` runs before it starts any role: each role's ``afd`` section
    (``--section``) against the ``VllmConfig`` the engine arguments make.  Writes
    ``{"refused": LINE}`` (exit 2) for a refused combination, ``{"failed": LINE}``
    (exit 3) when vLLM itself cannot build the config from these arguments, else
    ``{"deployments": {role: {...}}}`` (exit 0); with ``"model": {...}`` (the
    :class:`~afd_mrv2.admission.ModelFacts` read) once the model's layers were built.  vLLM's own log goes to this
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
    try:  # first (no config is built for arguments vLLM refuses): what the FFN role would drop, since it
        # takes engine arguments only, but the Attention engine would refuse
        check_serve_arguments(vllm_args)
    except AfdError as exc:
        result: dict[str, Any] = {"refused": str(exc)}
    else:
        result = _check_roles(args.model, [json.loads(text) for text in args.section], args, vllm_args)
    with open(args.out, "w") as out:
        json.dump(result, out)
    return 2 if "refused" in result else 3 if "failed" in result else 0


if __name__ == "__main__":
    sys.exit(main())
