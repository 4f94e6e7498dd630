"""The Attention-side runner: the platform's V2 model runner, extended by subclassing.

:func:`attention_runner_class` builds ``AfdAttention<Base>``.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.attention.runner".
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from afd_mrv2.config import AfdConfig
from afd_mrv2.errors import ConfigError, PipelineError
from afd_mrv2.mrv2.attention.handoff import current_step
from afd_mrv2.mrv2.attention.remote import RemoteExperts, attached
from afd_mrv2.mrv2.attention.split_policy import SplitPolicy, afd_graph_manager_class
from afd_mrv2.mrv2.attention.step_stats import StepStats, batch_kind
from afd_mrv2.mrv2.attention.ubatch_runner import UBATCH_STREAM_ROLES, AfdUBatchRunnerMixin, afd_ubatch_runner_class
from afd_mrv2.mrv2.deployment import admit
from afd_mrv2.mrv2.upstream import Upstream
from afd_mrv2.pipeline.executor import CloseReport
from afd_mrv2.validation import Gate

if TYPE_CHECKING:
    from afd_mrv2.mrv2.upstream import V2RunnerSurface as _RunnerBase
else:
    _RunnerBase = object  # the platform runner is the next base of the composed class


class AfdAttentionRunnerMixin(_RunnerBase):
    """Mixed in before the platform runner; see docs/internals/vllm-roles.md."""

    _afd_upstream: Upstream
    _afd_gate: Gate | None = None

    def __init__(self, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        # before upstream's constructor and any AFD resource; triton: this V2 runner's modules imported Triton
        config = admit(vllm_config, gate=type(self)._afd_gate, v2_runner=True, triton=True)
        if config is not None and config.role != "attention":
            raise ConfigError("afd.role", f"the Attention runner serves role attention, got {config.role!r}")
        self.afd_config: AfdConfig | None = config
        self.afd_remote: RemoteExperts | None = None
        self.afd_policy: SplitPolicy | None = None
        self.afd_steps = StepStats()
        self._afd_forward_start_ns = 0
        self._afd_forward_ns = 0
        super().__init__(vllm_config, device, *args, **kwargs)

    # ------------------------------------------------------------------ upstream's methods, extended

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)
        if self.afd_config is not None:
            self.model.register_forward_pre_hook(self._afd_forward_begins)
            self.model.register_forward_hook(self._afd_forward_ends)
        return result

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self.afd_config is None:
            return
        remote = self._afd_attached()
        if remote is None or remote.num_layers == 0:
            raise PipelineError(
                "afd role attention, but the loaded model built no AFD MoE layer: the afd_mrv2 vLLM plugin did "
                "not run in this worker (VLLM_PLUGINS must include afd_mrv2) or the model has no RoutedExperts"
            )
        self.afd_remote = remote
        if self.afd_config.ubatch.enabled:
            self._afd_install_ubatching(remote)

    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False, **kwargs: Any
    ) -> Any:
        if self.afd_config is None:
            return super().execute_model(scheduler_output, intermediate_tensors, dummy_run, **kwargs)
        policy, ubatch = self.afd_policy, self._afd_ubatch_runner()
        runs = ubatch.afd_runs if ubatch is not None else 0
        self._afd_forward_ns = 0
        ok = False
        try:
            with policy.paused() if dummy_run and policy is not None else nullcontext():
                output = super().execute_model(scheduler_output, intermediate_tensors, dummy_run, **kwargs)
            ok = True
            return output
        finally:
            split = ubatch is not None and ubatch.afd_runs > runs
            stages = ubatch.num_ubatches if split and ubatch is not None else 1
            if self.afd_remote is not None:
                self.afd_remote.meter.end_step(stages)
            if not ok:
                self.afd_steps.record_failure()
            else:
                forward_ns = ubatch.afd_last_forward_ns if split and ubatch is not None else self._afd_forward_ns
                if forward_ns:
                    self.afd_steps.record(self._afd_batch_kind(dummy_run), stages, forward_ns)

    # ------------------------------------------------------------------ micro-batching

    def _afd_install_ubatching(self, remote: RemoteExperts) -> None:
        """Per-micro-batch metadata builders, afd-mrv2's micro-batch runner and split policy (docs/internals/vllm-roles.md)."""
        assert self.afd_config is not None
        n = self.afd_config.ubatch.num_ubatches
        api = type(self)._afd_upstream.ubatch
        block_sizes = list(self.kernel_block_sizes)
        for group_id, groups in enumerate(self.attn_groups):
            block = block_sizes[group_id] if group_id < len(block_sizes) else None
            for group in groups:
                group.create_metadata_builders(
                    self.vllm_config,
                    self.device,
                    kernel_block_size=block,
                    num_metadata_builders=n,
                )
        backend, streams = remote.create_streams(UBATCH_STREAM_ROLES)
        self.ubatch_runner = afd_ubatch_runner_class(api)(
            self.vllm_config,
            self.device,
            self.model_state,
            self.attn_groups,
            self.kv_cache_config,
            self.max_num_reqs,
            num_ubatches=n,
            backend=backend,
            streams=streams,
        )
        built = self.cudagraph_manager
        policy = SplitPolicy(self.afd_config.ubatch, decode_query_len=built.decode_query_len)
        self.cudagraph_manager = afd_graph_manager_class(api.graph_manager)(
            self.vllm_config,
            self.device,
            built.cudagraph_mode,
            decode_query_len=built.decode_query_len,
            lora_capture_cases=built.lora_capture_cases,
            varlen_decode=built.varlen_decode,
            ubatch_runner=self.ubatch_runner,
            policy=policy,
        )
        policy.activate()
        self.afd_policy = policy

    def _afd_attached(self) -> RemoteExperts | None:
        """This process's MoE-seam session (:func:`~afd_mrv2.mrv2.attention.remote.attached`), built by the model's layers."""
        return attached()

    def _afd_ubatch_runner(self) -> AfdUBatchRunnerMixin | None:
        runner = self.ubatch_runner
        return runner if isinstance(runner, AfdUBatchRunnerMixin) else None

    # ------------------------------------------------------------------ accounting

    def _afd_forward_begins(self, module: object, args: object) -> None:
        del module, args
        if current_step() is None:  # unsplit (a split step's micro-batches are timed by the ubatch runner)
            self._afd_forward_start_ns = time.perf_counter_ns()
            if self.afd_remote is not None:
                self.afd_remote.step_started()

    def _afd_forward_ends(self, module: object, args: object, output: object) -> None:
        del module, args, output
        if current_step() is None and self._afd_forward_start_ns:
            self._afd_forward_ns = time.perf_counter_ns() - self._afd_forward_start_ns
            self._afd_forward_start_ns = 0

    def _afd_batch_kind(self, dummy_run: bool) -> str:
        state = self.execute_model_state
        if dummy_run or state is None:
            return "dummy"
        batch = state.input_batch
        return batch_kind(batch.is_prefilling_np[: batch.num_reqs])

    def afd_runner_stats(self) -> dict[str, Any]:
        """The step accounting (:class:`~afd_mrv2.mrv2.attention.step_stats.StepStats`) and the micro-batch count."""
        ubatch = self._afd_ubatch_runner()
        return {"num_ubatches": 1 if ubatch is None else ubatch.num_ubatches, **self.afd_steps.as_dict()}

    def afd_close(self, deadline_s: float | None = None) -> CloseReport | None:
        if self.afd_policy is not None:
            self.afd_policy.deactivate()
        return None if self.afd_remote is None else self.afd_remote.close(deadline_s)


_RUNNERS: dict[tuple[type, int], type] = {}


def attention_runner_class(upstream: Upstream, *, gate: Gate | None = None) -> type:
    """``AfdAttention<PlatformRunner>`` for ``upstream`` (cached per upstream runner and gate)."""
    key = (upstream.platform_runner, id(gate))
    if key not in _RUNNERS:
        base = upstream.platform_runner
        _RUNNERS[key] = type(
            f"AfdAttention{base.__name__}",
            (AfdAttentionRunnerMixin, base),
            {
                "__module__": __name__,
                "__doc__": f"{base.__qualname__} extended for the AFD Attention role.",
                "_afd_upstream": upstream,
                "_afd_gate": staticmethod(gate) if gate is not None else None,
            },
        )
    return _RUNNERS[key]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def runner_info(runner: object, worker: object) -> dict[str, Any]:
    """What ``runner`` (held by ``worker``) is: class and MRO names, whether it is this module's
    Attention composition, over which upstream runner, whether its AFD session is the
    MoE seam's, and its micro-batch runner's class.  The worker extension's ``afd_runner_info``
    returns it from inside vLLM's worker."""
    over, seam, ubatch = None, False, None
    if isinstance(runner, AfdAttentionRunnerMixin):
        over = _qualname(type(runner)._afd_upstream.platform_runner)
        seam = runner.afd_remote is not None and runner.afd_remote is runner._afd_attached()
        built = runner._afd_ubatch_runner()
        ubatch = None if built is None else _qualname(type(built))
    return {
        "worker": _qualname(type(worker)),
        "worker_mro": [_qualname(c) for c in type(worker).__mro__],
        "runner": _qualname(type(runner)),
        "runner_mro": [_qualname(c) for c in type(runner).__mro__],
        "afd_composition": over is not None,
        "composed_over": over,
        "moe_seam_session": seam,
        "ubatch_runner": ubatch,
    }
