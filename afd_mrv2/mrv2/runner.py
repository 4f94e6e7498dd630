"""The Attention-side runner: the platform's V2 model runner, extended by subclassing.

:func:`attention_runner_class` builds ``AfdAttention<Base>``, a subclass of the
platform runner the compat decision chose (vLLM's ``GPUModelRunner`` on CUDA,
vLLM-Ascend's ``NPUModelRunner`` on Ascend), through the typed
:class:`~afd_mrv2.mrv2.upstream.Upstream` adapter.  It overrides two methods and
copies no upstream code:

``__init__(vllm_config, device, ...)``
    validates ``additional_config["afd"]`` and the runtime pair
    (:func:`afd_mrv2.validation.validate`) and the support matrix on the real
    ``VllmConfig`` (:func:`afd_mrv2.mrv2.deployment.check_vllm_deployment`)
    **before** calling the upstream constructor, so a bad config, an unsupported
    combination or a refused pair fails before any upstream state, stream or
    communication resource exists.
``initialize_kv_cache(kv_cache_config, *args, **kwargs)``
    calls upstream (which builds ``self.ubatch_runner`` when microbatching is on),
    then builds the AFD side (plugins, device backend, executor, the exchange
    whose ``start`` / ``finish`` the model layers call, its transfer-state pool
    sized from the executor's buffer counts)
    and, if upstream built a ubatch runner, replaces it with an
    ``AfdUBatchRunner`` constructed from the same six arguments, whose comm and
    capture streams come from ``create_streams`` on the executor's backend.
    ``*args/**kwargs`` pass through: vLLM 0.33 takes ``is_profiling`` and
    ``kv_cache_allocation_context``, vLLM-Ascend's override takes neither.

Inside a real vLLM (``moe_seam=True``, what the workers of :mod:`afd_mrv2.mrv2.worker`
build) the transfers are carried by the model's MoE layers: vLLM builds every
routed-experts layer as afd-mrv2's out-of-tree replacement
(:mod:`afd_mrv2.mrv2.experts`), and those hand each call to the process's
:class:`~afd_mrv2.mrv2.remote.RemoteExperts`.  ``initialize_kv_cache`` then builds no
executor of its own (a second one would need a second link to the FFN role): it
checks that the loaded model did build its AFD MoE layers (else the afd-mrv2 vLLM
plugin was not loaded in this process, e.g. ``VLLM_PLUGINS`` leaves it out) and holds
that session as ``afd_remote``; ``afd_close`` closes it.  Micro-batching is refused
there (the MoE seam numbers its items per layer, stage 0 only).

Known gap (see docs/rfc/0002-ascend-mrv2.md): upstream hands the ubatch runner it
built to its CUDA-graph manager inside ``initialize_kv_cache``; FULL-graph capture
of microbatched steps would still use that one, so the ``graph`` capability is
granted by no runtime pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from afd_mrv2.config import AfdConfig
from afd_mrv2.devices import DeviceBackend, Stream, make_backend
from afd_mrv2.errors import ConfigError, PipelineError, PluginError
from afd_mrv2.items import WorkItem
from afd_mrv2.mrv2.deployment import check_vllm_deployment
from afd_mrv2.mrv2.exchange import UBatchExchange
from afd_mrv2.mrv2.remote import RemoteExperts, attached
from afd_mrv2.mrv2.ubatch_runner import UBATCH_ROLES, afd_ubatch_runner_class
from afd_mrv2.mrv2.upstream import Upstream
from afd_mrv2.pipeline.executor import CloseReport, Executor
from afd_mrv2.plugins import Plugins, load_plugins
from afd_mrv2.validation import Gate, validate


@dataclass
class AttentionAfd:
    """What the Attention runner owns for AFD once its KV cache exists."""

    config: AfdConfig
    plugins: Plugins
    backend: DeviceBackend
    executor: Executor
    exchange: UBatchExchange
    ubatch_streams: dict[str, Stream]

    @classmethod
    def build(
        cls,
        config: AfdConfig,
        upstream: Upstream,
        compute: Callable[[WorkItem, Any], Any],
        *,
        num_ubatches: int = 1,
    ) -> AttentionAfd:
        # a micro-batched step's items are stage i of num_ubatches, an unsplit step's stage 0 of 1
        exchange = UBatchExchange(
            upstream.current_ubatch_id, num_stages=lambda: num_ubatches if upstream.ubatching_active() else 1
        )
        plugins = load_plugins(config, resources=exchange.resources())
        backend = make_backend(config.multistream.backend)
        executor = Executor(plugins, backend, config.multistream, compute=compute, role="attention")
        exchange.bind(executor)
        ms = config.multistream
        stream_config = ms if ms.active_for("attention") else replace(ms, enabled=False)
        try:
            streams = plugins.create_streams(backend, UBATCH_ROLES, stream_config)
        except PluginError as exc:
            executor.close(0.0)
            raise PipelineError(str(exc)) from None
        return cls(config, plugins, backend, executor, exchange, streams)

    def close(self, deadline_s: float | None = None) -> CloseReport:
        return self.executor.close(deadline_s)


class AfdAttentionRunnerMixin:
    """Mixed in before the platform runner; see the module docstring."""

    _afd_upstream: Upstream
    _afd_gate: Gate | None = None
    _afd_moe_seam: bool = False  # inside a real vLLM: the MoE layers carry the transfers (module docstring)

    def __init__(self, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        config = validate(vllm_config.additional_config, gate=type(self)._afd_gate, v2_runner=True)
        if config is not None and config.role != "attention":
            raise ConfigError("afd.role", f"the Attention runner serves role attention, got {config.role!r}")
        if config is not None:  # the support matrix, before upstream's constructor and any AFD resource
            check_vllm_deployment(config, vllm_config, moe_seam=type(self)._afd_moe_seam)
        self.afd_config: AfdConfig | None = config
        self.afd: AttentionAfd | None = None
        self.afd_remote: RemoteExperts | None = None
        super().__init__(vllm_config, device, *args, **kwargs)

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)  # type: ignore[misc]
        if self.afd_config is None:
            return
        if type(self)._afd_moe_seam:
            self._adopt_moe_seam()
            return
        if self.afd is not None:  # re-initialisation: the old executor's streams go with it
            self.afd.close()
        upstream = type(self)._afd_upstream
        self.afd = AttentionAfd.build(
            self.afd_config,
            upstream,
            self.afd_compute,
            num_ubatches=self.vllm_config.parallel_config.num_ubatches,  # type: ignore[attr-defined]
        )
        built = self.ubatch_runner  # type: ignore[has-type]
        if built is not None:
            cls = afd_ubatch_runner_class(upstream.ubatch_runner)
            self.ubatch_runner = cls(
                self.vllm_config,  # type: ignore[attr-defined]
                self.device,  # type: ignore[attr-defined]
                self.model_state,  # type: ignore[attr-defined]
                self.attn_groups,  # type: ignore[attr-defined]
                self.kv_cache_config,  # type: ignore[attr-defined]
                self.max_num_reqs,  # type: ignore[attr-defined]
                afd_streams=self.afd.ubatch_streams,
            )

    def _adopt_moe_seam(self) -> None:
        remote = attached()
        if remote is None or remote.num_layers == 0:
            raise PipelineError(
                "afd role attention, but the loaded model built no AFD MoE layer: the afd_mrv2 vLLM plugin did "
                "not run in this worker (VLLM_PLUGINS must include afd_mrv2) or the model has no RoutedExperts"
            )
        if self.ubatch_runner is not None:  # type: ignore[has-type]
            raise PipelineError(
                "micro-batching (dual-batch overlap) with the vLLM MoE seam is not supported: the seam numbers "
                "its transfers per layer, stage 0 only; disable --enable-dbo"
            )
        self.afd_remote = remote

    def afd_compute(self, item: WorkItem, inputs: Any) -> Any:
        """The executor's compute function on the Attention side: what runs between
        receiving a microbatch's hidden states and sending them (identity by default;
        a gate computed on the Attention side goes here)."""
        return inputs

    def afd_close(self, deadline_s: float | None = None) -> CloseReport | None:
        if self.afd_remote is not None:
            return self.afd_remote.close(deadline_s)
        return None if self.afd is None else self.afd.close(deadline_s)


_RUNNERS: dict[tuple[type, int, bool], type] = {}


def attention_runner_class(upstream: Upstream, *, gate: Gate | None = None, moe_seam: bool = False) -> type:
    """``AfdAttention<PlatformRunner>`` for ``upstream`` (cached per upstream, gate and ``moe_seam``).

    ``moe_seam``: True inside a real vLLM, where the model's MoE layers carry the
    transfers (see the module docstring); False where the owner's model calls the
    runner's exchange itself (the embedded composition and its tests).
    """
    key = (upstream.platform_runner, id(gate), moe_seam)
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
                "_afd_moe_seam": moe_seam,
            },
        )
    return _RUNNERS[key]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def runner_info(runner: object, worker: object) -> dict[str, Any]:
    """What ``runner`` (held by ``worker``) is: class and MRO names, whether it is this module's
    Attention composition, over which upstream runner, and whether its AFD session is the
    MoE seam's.  The worker extension's ``afd_runner_info`` returns it from inside vLLM's worker."""
    over, seam = None, False
    if isinstance(runner, AfdAttentionRunnerMixin):
        over = _qualname(type(runner)._afd_upstream.platform_runner)
        seam = runner.afd_remote is not None and runner.afd_remote is attached()
    return {
        "worker": _qualname(type(worker)),
        "worker_mro": [_qualname(c) for c in type(worker).__mro__],
        "runner": _qualname(type(runner)),
        "runner_mro": [_qualname(c) for c in type(runner).__mro__],
        "afd_composition": over is not None,
        "composed_over": over,
        "moe_seam_session": seam,
    }
