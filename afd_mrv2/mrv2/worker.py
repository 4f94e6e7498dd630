"""The vLLM workers that build the AFD Attention runner.

Two upstream shapes, one composition (:func:`~afd_mrv2.mrv2.runner.attention_runner_class`):

* vLLM 0.33.0's ``Worker`` constructs its model runner in ``_make_model_runner()``
  ("subclasses override this"; seam ``Worker._make_model_runner``, capability
  ``worker_runner_factory``).  :func:`afd_worker_class` subclasses a worker class
  and overrides only that method: with an ``afd`` section of role ``attention`` it
  builds the Attention runner, else it defers to upstream.
  ``--worker-cls afd_mrv2.mrv2.worker.AfdWorker``.
* vLLM's ``CPUWorker`` builds its runner inline in ``init_device()`` (it never calls
  ``_make_model_runner``; seams ``CPUWorker.init_device`` and the V2
  ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``, capability ``mrv2``).
  :func:`afd_cpu_worker_class` subclasses it and overrides only ``init_device``:
  upstream's runs first (device, threads, distributed set-up, the runner); then,
  when the V2 runner is selected (``use_v2_model_runner``, which upstream's
  ``Worker.__init__`` assigned) and the ``afd`` section has role ``attention``,
  ``self.model_runner`` becomes the Attention runner composed over upstream's V2
  ``CPUModelRunner``, built from the same ``(vllm_config, device)``.  The runner
  upstream built is dropped before ``load_model``: nothing has used it yet.  Under
  the V1 runner the worker is upstream's unchanged (the MoE seam carries AFD there
  without any runner of afd-mrv2's).  ``--worker-cls afd_mrv2.mrv2.worker.AfdCPUWorker``.

Both build the same Attention runner (:func:`~afd_mrv2.mrv2.runner.attention_runner_class`)
over their platform's V2 runner, whose MoE layers carry the transfers through the same
MoE seam, micro-batched or not (``afd.ubatch``).
Both names resolve lazily from the
installed runtime (the compat decision must accept it; Ascend is refused by every
current pair).  The worker extension's ``afd_runner_info`` reports, from inside the
worker, which runner it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from afd_mrv2.items import ATTENTION
from afd_mrv2.mrv2.upstream import Upstream, load_upstream
from afd_mrv2.validation import Gate, afd_section


def _attention_role(vllm_config: Any) -> bool:
    raw = afd_section(vllm_config.additional_config)
    return isinstance(raw, Mapping) and raw.get("role") == ATTENTION


def afd_worker_class(base_worker: type, upstream: Upstream, *, gate: Gate | None = None) -> type:
    from afd_mrv2.mrv2.runner import attention_runner_class

    runner_cls = attention_runner_class(upstream, gate=gate)

    def _make_model_runner(self: Any) -> Any:
        if _attention_role(self.vllm_config):
            return runner_cls(self.vllm_config, self.device)
        return super(cls, self)._make_model_runner()

    cls = type(
        f"Afd{base_worker.__name__}", (base_worker,), {"__module__": __name__, "_make_model_runner": _make_model_runner}
    )
    return cls


def afd_cpu_worker_class(base_worker: type, upstream: Callable[[], Upstream], *, gate: Gate | None = None) -> type:
    """``AfdCPUWorker``: ``base_worker`` (vLLM's ``CPUWorker``) whose ``init_device`` installs the
    Attention runner under the V2 runner; see the module docstring.

    ``upstream`` is called only when the composition is built (the V2 runner's modules
    import Triton, which a V1 CPU worker must not need).
    """
    from afd_mrv2.mrv2.runner import attention_runner_class

    def init_device(self: Any) -> None:
        super(cls, self).init_device()
        if self.use_v2_model_runner and _attention_role(self.vllm_config):
            runner_cls = attention_runner_class(upstream(), gate=gate)
            self.model_runner = runner_cls(self.vllm_config, self.device)

    cls = type(f"Afd{base_worker.__name__}", (base_worker,), {"__module__": __name__, "init_device": init_device})
    return cls


def __getattr__(name: str) -> Any:
    if name not in ("AfdWorker", "AfdCPUWorker"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from afd_mrv2.compat import CompatRefused, check_runtime, v2_runner_selected, vllm_path_capabilities

    if name == "AfdCPUWorker":
        # moe_seam always, mrv2 when V2 is selected (the runner checks again from the engine's own config)
        decision = check_runtime(vllm_path_capabilities(v2_runner=v2_runner_selected()))
        if not decision.accepted:
            raise CompatRefused(decision)
        if decision.platform != "cpu":
            raise RuntimeError(f"AfdCPUWorker serves vLLM's CPU platform; this runtime is {decision.platform}")
        from vllm.v1.worker.cpu_worker import CPUWorker

        return afd_cpu_worker_class(CPUWorker, lambda: load_upstream("cpu"))
    decision = check_runtime(("mrv2", "worker_runner_factory"))
    if not decision.accepted:
        raise CompatRefused(decision)
    from vllm.v1.worker.gpu_worker import Worker

    return afd_worker_class(Worker, load_upstream(decision.platform))
