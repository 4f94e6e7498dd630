"""The vLLM worker that builds the AFD Attention runner.

vLLM 0.33.0's ``Worker`` constructs its model runner in ``_make_model_runner()``
("subclasses override this"; seam ``Worker._make_model_runner``, capability
``worker_runner_factory``).  :func:`afd_worker_class` subclasses a worker class
and overrides only that method: with an ``afd`` section of role ``attention`` it
builds the runner from :func:`~afd_mrv2.mrv2.runner.attention_runner_class`, else
it defers to upstream.

For ``vllm serve``: ``--worker-cls afd_mrv2.mrv2.worker.AfdWorker`` (resolved lazily
from the installed runtime: the compat decision chooses the platform and must
grant ``worker_runner_factory``; Ascend is refused by every current pair).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from afd_mrv2.mrv2.upstream import Upstream, load_upstream
from afd_mrv2.validation import Gate


def afd_worker_class(base_worker: type, upstream: Upstream, *, gate: Gate | None = None) -> type:
    from afd_mrv2.mrv2.runner import attention_runner_class

    runner_cls = attention_runner_class(upstream, gate=gate)

    def _make_model_runner(self: Any) -> Any:
        extra = self.vllm_config.additional_config
        if isinstance(extra, Mapping) and "afd" in extra and extra["afd"].get("role") == "attention":
            return runner_cls(self.vllm_config, self.device)
        return super(cls, self)._make_model_runner()

    cls = type(
        f"Afd{base_worker.__name__}", (base_worker,), {"__module__": __name__, "_make_model_runner": _make_model_runner}
    )
    return cls


def __getattr__(name: str) -> Any:
    if name != "AfdWorker":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from afd_mrv2.compat import CompatRefused, check_runtime

    decision = check_runtime(("mrv2", "worker_runner_factory"))
    if not decision.accepted:
        raise CompatRefused(decision)
    from vllm.v1.worker.gpu_worker import Worker

    return afd_worker_class(Worker, load_upstream(decision.platform))
