"""The upstream seams afd-mrv2 relies on, declared as data.

:class:`Seam` and the lists :data:`SEAMS`, :data:`STEP_SEAMS`, :data:`UBATCH_SEAMS`,
:data:`MOE_SEAMS`, :data:`VLLM_PATH_SEAMS`, :data:`~afd_mrv2.compat.ascend_seams.ASCEND_SEAMS`,
checked from source by :mod:`afd_mrv2.compat.contracts`.

See docs/internals/compat.md, "afd_mrv2.compat.seams".
"""

from __future__ import annotations

from afd_mrv2.compat.ascend_seams import ASCEND_SEAMS
from afd_mrv2.compat.moe_seams import MOE_SEAMS
from afd_mrv2.compat.seam import Seam
from afd_mrv2.compat.ubatch_seams import RUNNER, UBATCH_SEAMS, UBATCHING

MRV2 = "mrv2"
#: Where a vLLM release keeps its OpenAI server's ``make_arg_parser``: one of the two is offered (never granted
#: by a table row: the pre-flight uses whichever the installed vLLM has).
SERVE_PARSER_IN_LAUNCHERS, SERVE_PARSER_IN_COMMON = "serve_parser@launchers", "serve_parser@common"


#: The V2-runner composition: the Attention runner over the platform's V2 runner (the stand-ins in
#: tests/standins model these).
SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.__init__",
        "the Attention runner subclasses the platform runner and is built with (vllm_config, device); every "
        "step it reads ubatch_runner (afd-mrv2's micro-batch runner or not)",
        params=("vllm_config", "device"),
        assigns=("ubatch_runner",),
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.initialize_kv_cache",
        "overridden (the rest passes through *args/**kwargs): after upstream's, the Attention runner checks "
        "the MoE seam's session and installs micro-batching",
        params=("kv_cache_config",),
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.load_model",
        "overridden (*args/**kwargs): after upstream's, forward hooks on self.model time unsplit forwards",
        assigns=("model",),
    ),
    Seam(
        "vllm",
        UBATCHING,
        "",
        "the MoE seam hands over between micro-batches with dbo_yield (a module-level name, not a def)",
        names=("dbo_yield",),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        UBATCHING,
        "dbo_current_ubatch_id",
        "the MoE seam tags work items with the calling micro-batch's index (every Attention role imports it)",
        params=(),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        UBATCHING,
        "dbo_enabled",
        "the MoE seam tags a micro-batched step's items with the micro-batch count, others with 1 (every "
        "Attention role imports it)",
        params=(),
        capability="moe_seam",
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
        "AfdWorker overrides it to build the Attention runner under the V2 runner (use_v2_model_runner, as "
        "upstream decides there) and defers to it otherwise",
        params=(),
        uses=("use_v2_model_runner",),
        capability="worker_runner_factory",
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.gpu_worker",
        "Worker.init_device",
        "assigns self.device before the runner is built (through _make_model_runner): AfdWorker's override "
        "builds the Attention runner from (vllm_config, self.device)",
        params=(),
        assigns=("device",),
        capability="worker_runner_factory",
    ),
)

#: The V2 runner's step, as the Attention runner's accounting reads it (capability ``mrv2``).
STEP_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.execute_model",
        "overridden: upstream's is called as execute_model(scheduler_output, intermediate_tensors, dummy_run, "
        "**kwargs); afterwards the step's accounting reads execute_model_state",
        params=("scheduler_output", "intermediate_tensors", "dummy_run"),
        assigns=("execute_model_state",),
        capability=MRV2,
    ),
    Seam(
        "vllm",
        RUNNER,
        "ExecuteModelState",
        "the step's accounting reads the step's input batch from it",
        fields=("input_batch",),
        capability=MRV2,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.gpu.input_batch",
        "InputBatch",
        "the step's accounting classifies the batch (prefill, decode, mixed) from is_prefilling_np[:num_reqs]",
        fields=("num_reqs", "is_prefilling_np"),
        capability=MRV2,
    ),
)

_LAYERS = "serve's pre-flight child counts the MoE layers vLLM builds of the model, on the meta device (no weight read)"
#: What mrv2/deployment.built_model_facts uses to build the model's layers as vLLM's loaders do.
MODEL_LAYER_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        "vllm.model_executor.model_loader.utils",
        "initialize_model",
        f"{_LAYERS}: vLLM's own model construction",
        params=("vllm_config",),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.utils.torch_utils",
        "set_default_torch_dtype",
        f"{_LAYERS}, in the model's dtype",
        params=("dtype",),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.config.vllm",
        "set_current_vllm_config",
        f"{_LAYERS}, with the model's config current",
        params=("vllm_config",),
        capability="moe_seam",
    ),
    *(
        Seam(
            "vllm",
            "vllm.distributed.parallel_state",
            name,
            f"{_LAYERS}, in a one-rank process group it sets up and tears down",
            params=params,
            capability="moe_seam",
        )
        for name, params in (
            ("init_distributed_environment", ("world_size", "rank", "local_rank", "backend")),
            ("ensure_model_parallel_initialized", ("tensor_model_parallel_size", "pipeline_model_parallel_size")),
            ("destroy_model_parallel", ()),
            ("destroy_distributed_environment", ()),
        )
    ),
    Seam(
        "vllm",
        "vllm.config.model",
        "ModelConfig.get_num_layers",
        f"{_LAYERS}, and says how many layers it built",
        params=("parallel_config",),
        capability="moe_seam",
    ),
)

#: Upstream symbols the vLLM-path code uses beyond :data:`MOE_SEAMS` (afd_mrv2/mrv2/attention/experts.py,
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
        "vllm.config",
        "",
        "experts.py imports get_current_vllm_config from the package (re-exported from vllm.config.vllm)",
        names=("get_current_vllm_config",),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm.model_executor.layers.quantization.base_config",
        "",
        "experts.py imports QuantizationConfig (the annotation of _get_quant_method; the import runs)",
        names=("QuantizationConfig",),
        capability="moe_seam",
    ),
    Seam(
        "vllm",
        "vllm",
        "",
        "ffn_role builds the FFN role's engine with `from vllm import LLM`",
        names=("LLM",),
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
    Seam(
        "vllm",
        "vllm.entrypoints.launchers.cli_args",
        "make_arg_parser",
        "serve's pre-flight refuses arguments vLLM's OpenAI server would refuse, with that server's parser "
        "(its module in vLLM 0.30 to 0.32; mrv2/engine_args.SERVE_PARSER_MODULES takes whichever exists)",
        params=("parser",),
        capability=SERVE_PARSER_IN_LAUNCHERS,
    ),
    Seam(
        "vllm",
        "vllm.entrypoints.common.cli_args",
        "make_arg_parser",
        "the same parser where vLLM 0.33.0 moved it (mrv2/engine_args.SERVE_PARSER_MODULES)",
        params=("parser",),
        capability=SERVE_PARSER_IN_COMMON,
    ),
    Seam(
        "vllm",
        "vllm.config.model",
        "ModelConfig.get_num_experts",
        "serve's pre-flight and the FFN role refuse a model without routed experts (0) and an expert count "
        "the FFN ranks do not divide (mrv2/deployment.check_experts)",
        params=(),
        capability="moe_seam",
    ),
    *MODEL_LAYER_SEAMS,
)

#: Every seam: the V2-runner seams above, then the vLLM path's, then vLLM-Ascend's (checked only where a tree
#: holds vllm_ascend).
ALL_SEAMS: tuple[Seam, ...] = SEAMS + STEP_SEAMS + UBATCH_SEAMS + MOE_SEAMS + VLLM_PATH_SEAMS + ASCEND_SEAMS
