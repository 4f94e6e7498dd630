"""The upstream seams afd-mrv2 relies on, declared as data.

Each :class:`Seam` names one upstream symbol (module + qualname) and what the
shim relies on about it: parameter names in order, ``self`` attributes a method
assigns, base classes, class fields, module constants.  They are checked from
source with :mod:`ast` (:mod:`afd_mrv2.compat.contracts`), never by importing
upstream, so CI can check a downloaded wheel on a machine without a GPU.

``why`` says which part of afd-mrv2 breaks when the seam moves.  A seam with a
``capability`` is needed only for that capability: where it is missing, the
capability is reported as not offered instead of as a violation.
"""

from __future__ import annotations

from dataclasses import dataclass

UBATCH = "vllm.v1.worker.gpu.ubatch_utils"
RUNNER = "vllm.v1.worker.gpu.model_runner"
UBATCHING = "vllm.v1.worker.ubatching"
UBATCH_ARGS = ("vllm_config", "device", "model_state", "attn_groups", "kv_cache_config", "max_num_reqs")


@dataclass(frozen=True)
class Seam:
    distribution: str  # "vllm" | "vllm-ascend"
    module: str
    qualname: str
    why: str
    params: tuple[str, ...] | None = None  # required parameter names in order (self/cls excluded)
    assigns: tuple[str, ...] = ()  # attributes the function assigns on self
    bases: tuple[str, ...] = ()  # base class names (last dotted component)
    fields: tuple[str, ...] = ()  # annotated class-level fields
    constant: tuple[str, str] | None = None  # module-level NAME = "value"
    capability: str | None = None

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.qualname}"


SEAMS: tuple[Seam, ...] = (
    Seam("vllm", UBATCH, "UBatchRunner", "mrv2/ubatch.py subclasses it to route its streams"),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.__init__",
        "AfdUBatchRunner is constructed with these arguments; its comm_stream/capture_stream "
        "properties take over the two attributes __init__ assigns",
        params=UBATCH_ARGS,
        assigns=("comm_stream", "capture_stream"),
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.prepare",
        "called by the runner unchanged",
        params=("input_batch", "block_tables", "slot_mappings", "cg_mode", "for_capture"),
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.run",
        "called by the runner unchanged",
        params=("model", "model_inputs", "ubatch_state"),
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.begin_capturable_run",
        "reads self.comm_stream/self.capture_stream, which afd-mrv2 supplies",
        params=("model", "model_inputs", "ubatch_state", "for_capture"),
    ),
    Seam("vllm", UBATCH, "UBatchRunner.abort_pending_run", "failure path of a microbatched step", params=()),
    Seam(
        "vllm",
        UBATCH,
        "maybe_build_ubatch_runner",
        "decides whether a ubatch runner exists; afd-mrv2 wraps only what it built",
        params=UBATCH_ARGS,
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.__init__",
        "the Attention runner subclasses the platform runner; it reads these attributes to rebuild the ubatch runner",
        params=("vllm_config", "device"),
        assigns=("vllm_config", "device", "max_num_reqs", "ubatch_runner"),
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.initialize_kv_cache",
        "overridden to wrap the ubatch runner it builds",
        params=("kv_cache_config",),
        assigns=("kv_cache_config", "attn_groups", "ubatch_runner"),
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.load_model",
        "assigns model_state, an argument of UBatchRunner",
        assigns=("model_state",),
    ),
    Seam(
        "vllm",
        UBATCHING,
        "make_ubatch_contexts",
        "UBatchRunner hands it the streams afd-mrv2 supplies",
        params=("num_micro_batches", "compute_stream", "comm_stream", "forward_contexts", "ready_barrier"),
    ),
    Seam("vllm", UBATCHING, "dbo_current_ubatch_id", "the exchange tags work items with the microbatch id", params=()),
    Seam(
        "vllm",
        "vllm.config.vllm",
        "VllmConfig",
        "the runner reads additional_config['afd']",
        fields=("additional_config",),
    ),
    Seam(
        "vllm",
        "vllm.plugins",
        "DEFAULT_PLUGINS_GROUP",
        "afd-mrv2's register() is an entry point of this group",
        constant=("DEFAULT_PLUGINS_GROUP", "vllm.general_plugins"),
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.gpu_worker",
        "Worker._make_model_runner",
        "AfdWorker overrides it to build the Attention runner",
        params=(),
        capability="worker_runner_factory",
    ),
    Seam(
        "vllm-ascend",
        "vllm_ascend.worker.v2.model_runner",
        "NPUModelRunner",
        "the Ascend Attention runner subclasses it",
        bases=("GPUModelRunner",),
    ),
    Seam(
        "vllm-ascend",
        "vllm_ascend.worker.v2.model_runner",
        "NPUModelRunner.__init__",
        "constructed by the worker",
        params=("vllm_config", "device"),
    ),
    Seam(
        "vllm-ascend",
        "vllm_ascend.worker.v2.model_runner",
        "NPUModelRunner.initialize_kv_cache",
        "overridden (with *args/**kwargs: vllm-ascend drops is_profiling) to wrap the ubatch runner",
        params=("kv_cache_config",),
    ),
)
