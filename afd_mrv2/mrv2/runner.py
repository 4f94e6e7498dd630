"""The Attention-side runner: the platform's V2 model runner, extended by subclassing.

:func:`attention_runner_class` builds ``AfdAttention<Base>``, a subclass of the
platform runner the compat decision chose (vLLM's ``GPUModelRunner`` on CUDA,
vLLM-Ascend's ``NPUModelRunner`` on Ascend), through the typed
:class:`~afd_mrv2.mrv2.upstream.Upstream` adapter.  It overrides two methods and
copies no upstream code:

``__init__(vllm_config, device, ...)``
    validates ``additional_config["afd"]`` and the runtime pair
    (:func:`afd_mrv2.validation.validate`) **before** calling the upstream
    constructor, so a bad config or a refused pair fails before any upstream
    state, stream or communication resource exists.
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
from afd_mrv2.mrv2.exchange import UBatchExchange
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
    def build(cls, config: AfdConfig, upstream: Upstream, compute: Callable[[WorkItem, Any], Any]) -> AttentionAfd:
        exchange = UBatchExchange(upstream.current_ubatch_id)
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

    def __init__(self, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        config = validate(vllm_config.additional_config, gate=type(self)._afd_gate, v2_runner=True)
        if config is not None and config.role != "attention":
            raise ConfigError("afd.role", f"the Attention runner serves role attention, got {config.role!r}")
        self.afd_config: AfdConfig | None = config
        self.afd: AttentionAfd | None = None
        super().__init__(vllm_config, device, *args, **kwargs)

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)  # type: ignore[misc]
        if self.afd_config is None:
            return
        if self.afd is not None:  # re-initialisation: the old executor's streams go with it
            self.afd.close()
        upstream = type(self)._afd_upstream
        self.afd = AttentionAfd.build(self.afd_config, upstream, self.afd_compute)
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

    def afd_compute(self, item: WorkItem, inputs: Any) -> Any:
        """The executor's compute function on the Attention side: what runs between
        receiving a microbatch's hidden states and sending them (identity by default;
        a gate computed on the Attention side goes here)."""
        return inputs

    def afd_close(self, deadline_s: float | None = None) -> CloseReport | None:
        return None if self.afd is None else self.afd.close(deadline_s)


_RUNNERS: dict[tuple[type, int], type] = {}


def attention_runner_class(upstream: Upstream, *, gate: Gate | None = None) -> type:
    """``AfdAttention<PlatformRunner>`` for ``upstream`` (cached per upstream and gate)."""
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
