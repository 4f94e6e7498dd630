"""What a vLLM process admits an ``afd`` section on: the facts of its engine and model, and :func:`admit`.

:func:`deployment_of` reads the support matrix's :class:`~afd_mrv2.support_matrix.Deployment` from the
engine's real ``VllmConfig`` (a field this vLLM lacks goes into ``Deployment.unknown``, with a warning,
and every rule that needs it refuses); :func:`model_facts` and :func:`built_model_facts` read the model's
routed experts from its config or from the layers vLLM builds.  :func:`admit` runs the checks of
:mod:`afd_mrv2.admission` a process can know.  Which process runs which, and each field read (a seam
contract in :mod:`afd_mrv2.compat.moe_seams`): docs/vllm.md, "Admission".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from afd_mrv2.admission import Gate, ModelFacts, Stage, Subject, afd_section, run
from afd_mrv2.config import AfdConfig
from afd_mrv2.items import ATTENTION
from afd_mrv2.support_matrix import Deployment

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
        "data_parallel_rank": lambda: int(pc.data_parallel_rank),
        "tensor_parallel_rank": lambda: int(pc.rank) % max(1, int(pc.tensor_parallel_size)),
        "prefill_context_parallel_size": lambda: int(pc.prefill_context_parallel_size),
        "decode_context_parallel_size": lambda: int(pc.decode_context_parallel_size),
    }
    fields = {"tensor_parallel_rank": "rank"}  # a worker's rank in its engine (pipeline parallelism 1: its TP rank)
    sizes = {
        name: _read(name, f"parallel_config.{fields.get(name, name)}", read, unknown) for name, read in readers.items()
    }
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
    lora = _read("lora", "lora_config", lambda: vc.lora_config is not None, unknown)
    elastic = _read("elastic_ep", "parallel_config.enable_elastic_ep", lambda: bool(pc.enable_elastic_ep), unknown)
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
        lora=bool(lora),
        elastic_ep=bool(elastic),
        triton=default.triton if triton is None else triton,
        unknown=tuple(unknown),
        **{name: (0 if name.endswith("_rank") else 1) if value is None else value for name, value in sizes.items()},
    )


def process_rank(config: AfdConfig, deployment: Deployment) -> AfdConfig:
    """``config`` with this process's own AFD rank: on an Attention engine of ``attention_group_size`` > 1 (one
    vLLM deployment's DP x TP ranks), ``rank`` names the group's first AFD rank and every process of it adds its
    ``data_parallel_rank * tensor_parallel_size + tensor_parallel_rank``; otherwise ``config`` itself."""
    if config.role != ATTENTION or config.attention_group_size == 1:
        return config
    offset = deployment.data_parallel_rank * deployment.tensor_parallel_size + deployment.tensor_parallel_rank
    return dataclasses.replace(config, rank=config.rank + offset)


def check_vllm_deployment(config: AfdConfig, vllm_config: Any, *, triton: bool | None = None) -> Deployment:
    """The ``VLLM_CONFIG`` admission checks of ``config`` on the deployment ``vllm_config`` describes (the
    support matrix, then vLLM's native micro-batching on the MoE seam); raise :class:`ConfigError` (one line).

    Creates nothing; returns the deployment it checked.  ``triton``: see :func:`deployment_of`.
    """
    deployment = deployment_of(vllm_config, triton=triton)
    run(Subject(config, deployment=deployment), (Stage.VLLM_CONFIG,))
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

    The checks of :mod:`afd_mrv2.admission` this process can know, in their order: ``CONFIG`` (the
    section, its plugins), ``RUNTIME`` (the runtime pair grants what this process needs), ``VLLM_CONFIG``
    (the support matrix on this ``VllmConfig``) and, with ``model``, ``MODEL`` on the routed-expert count
    its config gives (:func:`model_facts`).  ``v2_runner`` None: the config's own ``use_v2_model_runner``;
    ``gate`` and ``triton``: see :func:`afd_mrv2.validation.validate` and :func:`deployment_of`.
    """
    raw = afd_section(vllm_config.additional_config)
    if raw is None:
        return None
    v2 = bool(getattr(vllm_config, "use_v2_model_runner", False)) if v2_runner is None else v2_runner
    subject = Subject(
        raw,
        v2_runner=v2,
        gate=gate,
        deployment=lambda: deployment_of(vllm_config, triton=triton),
        model=lambda: model_facts(vllm_config.model_config),
    )
    config = run(subject, (Stage.CONFIG, Stage.RUNTIME, Stage.VLLM_CONFIG, *((Stage.MODEL,) if model else ())))
    return process_rank(config, subject.deployment)  # an Attention group's process: its own rank (DP x TP)


def model_facts(model_config: Any) -> ModelFacts:
    """The model's :class:`~afd_mrv2.admission.ModelFacts` as its config gives them (layers unknown).

    ``model_config``: vLLM's ``ModelConfig`` (``get_num_experts()``, 0 for a dense model; ``architectures``).
    """
    architectures = tuple(getattr(model_config, "architectures", None) or ())
    return ModelFacts(architectures, int(model_config.get_num_experts() or 0))


def check_experts(config: AfdConfig, model_config: Any) -> int:
    """The ``MODEL`` admission checks on ``model_config``'s routed-expert count (a model without routed experts,
    or whose placement over ``afd.num_ffn_ranks`` fails: ``afd.placement``).  Returns the count."""
    facts = model_facts(model_config)
    run(Subject(config, model=facts), (Stage.MODEL,))
    return facts.num_experts


#: vLLM's engine arguments that lay the engine out over processes: the layer structure is built without them
#: (one process, no micro-batching), so that it needs no process group but its own (:func:`built_model_facts`).
LAYOUT_ARGS = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "data_parallel_size_local",
        "data_parallel_rank",
        "data_parallel_start_rank",
        "data_parallel_address",
        "data_parallel_rpc_port",
        "data_parallel_backend",
        "data_parallel_hybrid_lb",
        "data_parallel_external_lb",
        "prefill_context_parallel_size",
        "decode_context_parallel_size",
        "enable_expert_parallel",
        "enable_eplb",
        "all2all_backend",
        "enable_dbo",
        "ubatch_size",
        "distributed_executor_backend",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
    }
)


def built_model_facts(vllm_config: Any) -> ModelFacts:
    """The model's MoE layers as vLLM builds them, on the meta device: no weight is read or allocated.

    ``vllm_config``: a one-process config without an ``afd`` section (the engine arguments less
    :data:`LAYOUT_ARGS`): vLLM's own constructors build the model (``initialize_model``, as its loaders do,
    under ``torch.device("meta")`` as its IPC weight loader does) inside a one-rank gloo group on an
    in-memory store (no address, no port), and the routed-experts layers are counted.  For a throwaway
    process (serve's pre-flight child): vLLM's process groups are set up and torn down here, so the
    process must hold none (:class:`RuntimeError` otherwise).
    """
    import torch
    from vllm.config.vllm import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    if torch.distributed.is_initialized():
        raise RuntimeError("built_model_facts needs a process without a torch.distributed group")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), world_size=1, rank=0)
    try:
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
            ensure_model_parallel_initialized(1, 1)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config)
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
    return layer_facts(vllm_config, [m for m in model.modules() if isinstance(m, RoutedExperts)])


def layer_facts(vllm_config: Any, moe_layers: Sequence[Any]) -> ModelFacts:
    """The model's :class:`~afd_mrv2.admission.ModelFacts` from the routed-experts layers built of it (vLLM's
    ``RoutedExperts``: their ``moe_config.num_experts``), of ``vllm_config``'s model."""
    facts = model_facts(vllm_config.model_config)
    experts = int(moe_layers[0].moe_config.num_experts) if moe_layers else facts.num_experts
    layers = int(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
    return ModelFacts(facts.architectures, experts, len(moe_layers), layers)


def check_layers(config: AfdConfig, vllm_config: Any, moe_layers: Sequence[Any]) -> ModelFacts:
    """The ``MODEL`` admission checks on the routed-experts layers a process built (the FFN worker's loaded
    model); returns the facts checked."""
    facts = layer_facts(vllm_config, moe_layers)
    run(Subject(config, model=facts), (Stage.MODEL,))
    return facts
