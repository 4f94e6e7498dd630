"""The vLLM workers that build the AFD Attention runner: ``--worker-cls afd_mrv2.mrv2.attention.worker.AfdWorker``.

:func:`afd_worker_class`, :func:`afd_init_device_worker_class` (``AfdCPUWorker`` is deprecated).

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.attention.worker".
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from afd_mrv2.items import ATTENTION
from afd_mrv2.mrv2.platforms.attention import AttentionAdapter, attention_adapter
from afd_mrv2.mrv2.upstream import Upstream, load_upstream
from afd_mrv2.validation import Gate, afd_section

log = logging.getLogger(__name__)


def _attention_role(vllm_config: Any) -> bool:
    raw = afd_section(vllm_config.additional_config)
    return isinstance(raw, Mapping) and raw.get("role") == ATTENTION


def afd_worker_class(base_worker: type, upstream: Upstream, *, gate: Gate | None = None) -> type:
    from afd_mrv2.mrv2.attention.runner import attention_runner_class

    runner_cls = attention_runner_class(upstream, gate=gate)

    def _make_model_runner(self: Any) -> Any:
        if self.use_v2_model_runner and _attention_role(self.vllm_config):
            return runner_cls(self.vllm_config, self.device)
        return super(cls, self)._make_model_runner()

    cls: type[Any] = type(
        "AfdWorker", (base_worker,), {"__module__": __name__, "_make_model_runner": _make_model_runner}
    )
    return cls


def afd_init_device_worker_class(
    base_worker: type,
    upstream: Callable[[], Upstream],
    *,
    gate: Gate | None = None,
    adapter: AttentionAdapter | None = None,
) -> type:
    """``base_worker`` (vLLM's ``CPUWorker``, vLLM-Ascend's ``NPUWorker``) whose ``init_device`` installs the
    Attention runner under the V2 runner; see docs/internals/vllm-roles.md.

    ``upstream`` is called only when the composition is built (the V2 runner's modules
    import Triton, which a V1 CPU worker must not need).  ``adapter``: the platform's
    (:mod:`afd_mrv2.mrv2.platforms.attention`), whose layer is installed once ``base_worker.__init__``
    registered the platform's ops, before the model is built, on the Attention role only.
    """
    from afd_mrv2.mrv2.attention.runner import attention_runner_class

    def init_device(self: Any) -> None:
        super(cls, self).init_device()
        if self.use_v2_model_runner and _attention_role(self.vllm_config):
            runner_cls = attention_runner_class(upstream(), gate=gate)
            self.model_runner = runner_cls(self.vllm_config, self.device)

    namespace: dict[str, Any] = {"__module__": __name__, "init_device": init_device}
    if adapter is not None:

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            super(cls, self).__init__(*args, **kwargs)  # the platform registers its ops here
            if _attention_role(self.vllm_config):
                log.info("afd-mrv2: the Attention role's routed-experts layer: %s", adapter.install_attention_layer())

        namespace["__init__"] = __init__
    cls: type[Any] = type("AfdWorker", (base_worker,), namespace)
    return cls


#: Former name of the CPU composition (``--worker-cls afd_mrv2.mrv2.attention.worker.AfdCPUWorker``).
_DEPRECATED = {"AfdCPUWorker": "AfdWorker"}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        warnings.warn(
            f"{__name__}.{name} is deprecated; use {__name__}.{_DEPRECATED[name]} (one worker name on every platform)",
            DeprecationWarning,
            stacklevel=2,
        )
        name = _DEPRECATED[name]
    if name != "AfdWorker":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _afd_worker()


def _afd_worker() -> type:
    """The installed platform's AFD worker (see docs/internals/vllm-roles.md)."""
    from afd_mrv2.compat import CompatRefused, check_runtime, v2_runner_selected, vllm_path_capabilities

    # moe_seam always, mrv2 when V2 is selected (the runner checks again from the engine's own config)
    decision = check_runtime(vllm_path_capabilities(v2_runner=v2_runner_selected()))
    if not decision.accepted:
        raise CompatRefused(decision)
    platform = decision.platform
    adapter = attention_adapter(platform)  # the platform table: None where the general plugin's layer serves
    if platform == "cpu":
        from vllm.v1.worker.cpu_worker import CPUWorker

        return afd_init_device_worker_class(CPUWorker, lambda: load_upstream("cpu"), adapter=adapter)
    if platform == "ascend":
        from vllm_ascend.worker.worker import NPUWorker

        return afd_init_device_worker_class(NPUWorker, lambda: load_upstream("ascend"), adapter=adapter)
    decision = check_runtime(("mrv2", "worker_runner_factory"))
    if not decision.accepted:
        raise CompatRefused(decision)
    from vllm.v1.worker.gpu_worker import Worker

    return afd_worker_class(Worker, load_upstream(platform))
