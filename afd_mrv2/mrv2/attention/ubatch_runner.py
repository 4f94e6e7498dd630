"""afd-mrv2's own micro-batch runner for vLLM's ModelRunner V2: device-generic, at data parallelism 1.

:func:`afd_ubatch_runner_class` subclasses upstream's ``UBatchRunner``.

See docs/internals/micro-batching.md, "afd_mrv2.mrv2.attention.ubatch_runner".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch

from afd_mrv2.devices.base import DeviceBackend, Stream
from afd_mrv2.mrv2.attention.handoff import MicroBatchFailed, SplitStep, close_step, open_step
from afd_mrv2.mrv2.upstream import UBatchApi, UBatchContextSurface, UBatchSliceSurface, UBatchStateSurface

if TYPE_CHECKING:
    from afd_mrv2.mrv2.upstream import UBatchRunnerSurface as _UBatchRunnerBase
else:
    _UBatchRunnerBase = object  # upstream's UBatchRunner is the next base of the composed class

#: The stream roles the micro-batch runner asks ``create_streams`` for.
UBATCH_STREAM_ROLES = ("compute", "comm")

_CLASSES: dict[UBatchApi, type] = {}


class _SplitRun:
    """One split step: a thread per micro-batch, their outputs and errors, and what the caller holds meanwhile."""

    __slots__ = (
        "_api",
        "_backend",
        "_contexts",
        "_device",
        "_errors",
        "_model",
        "_outputs",
        "_stack",
        "_step",
        "_threads",
    )

    def __init__(
        self,
        api: UBatchApi,
        model: torch.nn.Module,
        contexts: list[UBatchContextSurface],
        *,
        backend: DeviceBackend,
        device: torch.device,
    ) -> None:
        self._api = api
        self._model = model
        self._contexts = contexts
        self._backend = backend
        self._device = device
        self._step = SplitStep(len(contexts), api.handoff)
        self._outputs: dict[int, object] = {}
        self._errors: dict[int, BaseException] = {}
        self._threads: list[threading.Thread] = []
        self._stack = ExitStack()

    def _run_ubatch(self, context: UBatchContextSurface, inputs: dict[str, Any]) -> None:
        """One micro-batch's thread: bind the device, run the model in its context, record the output or error."""
        step = self._step
        setup: BaseException | None = None
        try:
            self._backend.bind_thread(self._device)
        except BaseException as exc:  # noqa: BLE001 - the thread must still reach the barrier
            setup = exc
        try:
            with torch.inference_mode(), context:
                try:
                    if setup is not None:
                        raise setup
                    step.resumed(context.id)
                    step.check(context.id)  # a sibling failed before this one got the core
                    self._outputs[context.id] = self._model(**inputs)
                except BaseException as exc:  # noqa: BLE001 - reported by finish
                    # mark the step BEFORE the context's exit wakes the next micro-batch
                    self._errors[context.id] = exc
                    step.fail(context.id, exc)
        except BaseException as exc:  # noqa: BLE001 - the hand-off itself failed
            self._errors.setdefault(context.id, exc)
            step.fail(context.id, exc)

    def start(self, model_inputs: dict[str, Any], slices: list[UBatchSliceSurface]) -> None:
        """Hold the forward context, open the step and start one thread per micro-batch (they park at the barrier)."""
        self._stack.enter_context(self._api.override_forward_context(None))  # the threads own the forward context
        open_step(self._step)
        try:
            for context, ubatch_slice in zip(self._contexts, slices, strict=True):
                inputs = self._api.slice_model_inputs(model_inputs, ubatch_slice.token_slice)
                thread = threading.Thread(
                    target=self._run_ubatch, args=(context, inputs), name=f"afd-ubatch-{context.id}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        except BaseException:
            self.close()
            raise

    def join(self) -> None:
        """Release the first micro-batch and wait for every thread."""
        self._contexts[0].cpu_wait_event.set()
        for thread in self._threads:
            thread.join()

    def close(self) -> None:
        """Close the step and give the forward context back."""
        close_step(self._step)
        self._stack.close()

    def result(self) -> Any:
        """The merged outputs; :class:`MicroBatchFailed` naming the failed micro-batch when one failed."""
        if self._errors:
            failed, exc = self._step.failure or min(self._errors.items())
            raise MicroBatchFailed(failed, len(self._contexts), exc) from exc
        return self._api.merge_ubatch_outputs([self._outputs[i] for i in range(len(self._contexts))])


class AfdUBatchRunnerMixin(_UBatchRunnerBase):
    """Mixed in before upstream's ``UBatchRunner``; see docs/internals/micro-batching.md."""

    _afd_api: UBatchApi

    def __init__(
        self,
        vllm_config: Any,
        device: torch.device,
        model_state: Any,
        attn_groups: list[Any],
        kv_cache_config: Any,
        max_num_reqs: int,
        *,
        num_ubatches: int,
        backend: DeviceBackend,
        streams: Mapping[str, Stream],
    ) -> None:
        # upstream's __init__ is not called: it builds SM control (CUDA/ROCm only) and CUDA streams
        if num_ubatches < 2:
            raise ValueError(f"a micro-batch runner needs at least 2 micro-batches, got {num_ubatches}")
        if set(streams) != set(UBATCH_STREAM_ROLES):
            raise ValueError(f"streams needs exactly the roles {', '.join(UBATCH_STREAM_ROLES)}, got {sorted(streams)}")
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.num_ubatches = num_ubatches
        self.dcp_size = 1  # decode context parallelism is refused with micro-batching (support matrix)
        self.dcp_rank = 0
        self.cp_interleave = self.parallel_config.cp_kv_cache_interleave_size
        self.device = device
        self.model_state = model_state
        self.attn_groups = attn_groups
        self.kv_cache_config = kv_cache_config
        # query_start_loc and seq_lens are rebased onto each micro-batch's tokens: buffers of their own
        self.ubatch_query_start_loc = [
            torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device) for _ in range(num_ubatches)
        ]
        self.ubatch_seq_lens = [
            torch.zeros(max_num_reqs, dtype=torch.int32, device=device) for _ in range(num_ubatches)
        ]
        self.ubatch_dcp_local_seq_lens: list[torch.Tensor | None] = [None] * num_ubatches
        self.ready_barrier = threading.Barrier(num_ubatches + 1)
        self._pending_finish: Callable[[], Any] | None = None
        self.afd_backend = backend
        self.afd_streams = dict(streams)
        #: split steps run, and the wall time of the last one's forward (ns)
        self.afd_runs = 0
        self.afd_last_forward_ns = 0

    # ------------------------------------------------------------------ forward contexts

    def _make_forward_contexts(
        self,
        ubatch_slices: list[UBatchSliceSurface],
        attn_metadata: list[dict[str, Any]],
        slot_mappings_by_layer: list[dict[str, torch.Tensor]],
        is_padding: list[torch.Tensor | None],
    ) -> list[object]:
        """One forward context per micro-batch, without DP metadata (the engine runs at DP 1)."""
        create = self._afd_api.create_forward_context
        return [
            create(attn_metadata[i], self.vllm_config, slot_mapping=slot_mappings_by_layer[i], is_padding=is_padding[i])
            for i in range(len(ubatch_slices))
        ]

    # ------------------------------------------------------------------ the launcher

    def _afd_streams_native(self) -> tuple[object, object]:
        """(compute, comm) as ``UBatchContext`` takes them: the backend's native streams, else the caller's."""
        compute = self.afd_streams["compute"].native
        comm = self.afd_streams["comm"].native
        if compute is None:
            compute = self._afd_api.current_stream()
        return compute, compute if comm is None else comm

    def run(self, model: Any, model_inputs: dict[str, Any], ubatch_state: UBatchStateSurface) -> Any:
        start = time.perf_counter_ns()
        try:
            return super().run(model, model_inputs, ubatch_state)
        finally:
            self.afd_runs += 1
            self.afd_last_forward_ns = time.perf_counter_ns() - start

    def begin_capturable_run(
        self,
        model: torch.nn.Module,
        model_inputs: dict[str, Any],
        ubatch_state: UBatchStateSurface,
        for_capture: bool = False,
    ) -> Callable[[], Any]:
        """Start one thread per micro-batch, parked at the ready barrier; returns ``finish`` (run and join)."""
        if for_capture:
            raise RuntimeError("afd-mrv2's micro-batch runner captures no graphs (micro-batching requires eager)")
        api = self._afd_api
        n = self.num_ubatches
        slices, forward_contexts = ubatch_state.slices, ubatch_state.forward_contexts
        if not len(slices) == len(forward_contexts) == n:
            raise ValueError(f"{len(slices)} slices and {len(forward_contexts)} forward contexts for {n} micro-batches")
        compute, comm = self._afd_streams_native()
        contexts = api.make_ubatch_contexts(
            num_micro_batches=n,
            compute_stream=compute,
            comm_stream=comm,
            forward_contexts=forward_contexts,
            ready_barrier=self.ready_barrier,
        )
        run = _SplitRun(api, model, contexts, backend=self.afd_backend, device=self.device)
        run.start(model_inputs, slices)
        self.ready_barrier.wait()  # every thread is parked: nothing runs before finish

        def finish() -> Any:
            try:
                run.join()
            finally:
                self._pending_finish = None
                run.close()
            return run.result()

        self._pending_finish = finish
        return finish


def afd_ubatch_runner_class(api: UBatchApi) -> type:
    """``AfdUBatchRunner``: :class:`AfdUBatchRunnerMixin` over upstream's ``UBatchRunner`` (cached per api)."""
    base = api.base
    if api not in _CLASSES:
        _CLASSES[api] = type(
            f"Afd{base.__name__}",
            (AfdUBatchRunnerMixin, base),
            {
                "__module__": __name__,
                "__doc__": f"{base.__qualname__}, device-generic and at DP 1 (afd-mrv2's own micro-batch runner).",
                "_afd_api": api,
            },
        )
    return _CLASSES[api]
