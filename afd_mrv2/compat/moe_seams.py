"""The vLLM path's upstream seams (capability ``moe_seam``; on CPU also ``mrv2``).

See docs/internals/compat.md, "afd_mrv2.compat.moe_seams".
"""

from __future__ import annotations

from afd_mrv2.compat.deployment_seams import DEPLOYMENT_SEAMS
from afd_mrv2.compat.seam import Seam

CUSTOM_OP = "vllm.model_executor.custom_op"
FUSED_MOE = "vllm.model_executor.layers.fused_moe"
ROUTED = f"{FUSED_MOE}.routed_experts"
METHOD = f"{FUSED_MOE}.fused_moe_method_base"
TOPK = ("x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input")
MOE = "moe_seam"
#: an Attention group's DP ranks on nodes without its front end (afd_mrv2/serve/headless.py)
DP_NODES = "dp_nodes"
CPU = frozenset({"cpu"})
SHARED = f"{FUSED_MOE}.runner.shared_experts"
MOE_RUNNER = f"{FUSED_MOE}.runner.moe_runner"

#: The properties of a quant method that vLLM's MoE runner reads (the stand-in inherits them).
_RUNNER_READS = (
    "supports_internal_mk",
    "topk_indices_dtype",
    "skip_forward_padding",
    "has_unpadded_output",
    "is_monolithic",
)

EXPERT_MAP = f"{FUSED_MOE}.expert_map_manager"
LOADER = "vllm.model_executor.model_loader"

#: The held set (afd_mrv2/mrv2/held.py) and what the Attention role's layer reads for its refusals.
HELD_SEAMS: tuple[Seam, ...] = (
    Seam("vllm", EXPERT_MAP, "ExpertMapManager", "HeldExpertMap subclasses it", capability=MOE),
    Seam(
        "vllm",
        EXPERT_MAP,
        "ExpertMapManager.__init__",
        "HeldExpertMap is built from the factory's manager's attributes (no EPLB, no redundant experts); "
        "__init__ calls _calculate_expert_maps",
        params=(
            "max_num_batched_tokens",
            "top_k",
            "global_num_experts",
            "num_redundant_experts",
            "num_expert_group",
            "moe_parallel_config",
            "placement_strategy",
            "enable_eplb",
        ),
        assigns=(
            "max_num_batched_tokens",
            "top_k",
            "global_num_experts",
            "moe_parallel_config",
            "num_fused_shared_experts",
        ),
        uses=("_calculate_expert_maps",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        EXPERT_MAP,
        "ExpertMapManager._calculate_expert_maps",
        "overridden by HeldExpertMap: the held set's local count, int32 map (-1 elsewhere), no mask",
        params=(),
        assigns=("_local_num_experts", "_expert_map", "_expert_mask"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        EXPERT_MAP,
        "ExpertMapManager.map_global_to_local",
        "the loader's global -> local id: reads the map HeldExpertMap computed",
        params=("global_id",),
        uses=("_expert_map",),
        capability=MOE,
    ),
    *(
        Seam(
            "vllm",
            EXPERT_MAP,
            f"ExpertMapManager.{name}",
            "HeldExpertMap reads it",
            params=(),
            decorators=("property",),
            capability=MOE,
        )
        for name in ("placement_strategy", "local_num_experts")
    ),
    Seam(
        "vllm",
        ROUTED,
        "RoutedExperts._map_global_expert_id_to_local_expert_id",
        "weight_loader's id mapping goes through the layer's manager",
        params=("expert_id",),
        uses=("expert_map_manager", "map_global_to_local"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{FUSED_MOE}.layer",
        "FusedMoEFactory",
        "builds the routed-experts class (afd-mrv2's, through the registry) with the manager as a keyword; the "
        "FFN role's experts-only model calls it with these keywords",
        params=(
            "num_experts",
            "top_k",
            "hidden_size",
            "intermediate_size",
            "renormalize",
            "use_grouped_topk",
            "num_expert_group",
            "topk_group",
            "quant_config",
            "prefix",
            "scoring_func",
            "routed_scaling_factor",
            "ckpt_names",
            "apply_routed_scale_to_output",
        ),
        uses=("routed_experts_cls", "expert_map_manager"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{FUSED_MOE}.config",
        "FusedMoEParallelConfig",
        "the Attention role refuses EPLB and EP across ranks",
        fields=("ep_size", "use_ep", "enable_eplb"),
        capability=MOE,
    ),
)

#: The ``afd`` load format (afd_mrv2/mrv2/loader.py) over upstream's local-expert filter.
LOADER_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        LOADER,
        "register_model_loader",
        "the general plugin registers AfdModelLoader as load format 'afd'",
        params=("load_format",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.default_loader",
        "DefaultModelLoader",
        "AfdModelLoader subclasses it",
        bases=("BaseModelLoader",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.default_loader",
        "DefaultModelLoader.__init__",
        "AfdModelLoader hands it a copy of the load config (safetensors, lazy)",
        params=("load_config",),
        assigns=("local_expert_ids",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.default_loader",
        "DefaultModelLoader.load_weights",
        "overridden (held set read from the model first); calls _init_ep_weight_filter before reading",
        params=("model", "model_config"),
        uses=("_init_ep_weight_filter", "get_all_weights"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.default_loader",
        "DefaultModelLoader._init_ep_weight_filter",
        "overridden: local_expert_ids is the model's held set (Attention: empty)",
        params=("model_config",),
        assigns=("local_expert_ids",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.default_loader",
        "DefaultModelLoader._prepare_weights",
        "picks file patterns by load_format: the reason the base gets load_format='safetensors'",
        uses=("load_format",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.default_loader",
        "DefaultModelLoader._get_weights_iterator",
        "hands local_expert_ids to the safetensors iterator",
        uses=("local_expert_ids", "safetensors_weights_iterator"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.weight_utils",
        "safetensors_weights_iterator",
        "the lazy path asks should_skip_weight before reading a tensor",
        params=("hf_weights_files", "use_tqdm_on_load", "safetensors_load_strategy", "local_expert_ids"),
        uses=("should_skip_weight",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{LOADER}.ep_weight_filter",
        "should_skip_weight",
        "skips a per-expert weight whose id is not in the set (scales are kept)",
        params=("weight_name", "local_expert_ids"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.config.load",
        "LoadConfig",
        "AfdModelLoader reads and rewrites these",
        fields=("load_format", "safetensors_load_strategy", "model_loader_extra_config"),
        capability=MOE,
    ),
)

#: The FFN role's experts-only model (afd_mrv2/mrv2/ffn/model.py): registered by the plugin, attention-free.
FFN_MODEL_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        "vllm.model_executor.models.registry",
        "",
        "the general plugin registers AfdFfnExperts in vLLM's model registry",
        names=("ModelRegistry",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.model_executor.models.registry",
        "_ModelRegistry.register_model",
        "register_model(ARCHITECTURE, AfdFfnExperts)",
        params=("model_arch", "model_cls"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.model_executor.models.interfaces",
        "is_attention_free",
        "AfdFfnExperts declares is_attention_free: no KV-cache spec, so no KV cache and no memory profile",
        literals=("is_attention_free",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.v1.engine.core",
        "EngineCore._initialize_kv_caches",
        "an engine whose model has no KV-cache spec skips the profile run and allocates no KV cache",
        uses=("has_kv_cache",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{FUSED_MOE}.runner.moe_runner",
        "MoERunner.load_weights",
        "AfdFfnExperts hands each layer's checkpoint tensors (names relative to the layer) to it",
        params=("weights",),
        uses=("routed_experts", "load_weights"),
        capability=MOE,
    ),
)

#: An Attention group (one vLLM deployment's DP x TP ranks): what the seam's rows and rank come from.
GROUP_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        MOE_RUNNER,
        "MoERunner.do_naive_dispatch_combine",
        "the runner dispatches tokens among DP ranks (naive all-gather, then combine) unless the quant method "
        "says supports_internal_mk: the Attention stand-in says it does, so each DP rank sends only its own rows",
        params=(),
        uses=("dp_size", "is_sequence_parallel", "supports_internal_mk"),
        decorators=("property",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        METHOD,
        "FusedMoEMethodBase.supports_internal_mk",
        "overridden by the Attention stand-in (True); also read by LoRA's MoE layer and elastic EP, which "
        "admission refuses with AFD (seam-lora, seam-elastic-ep)",
        params=(),
        decorators=("property",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        MOE_RUNNER,
        "MoERunner._maybe_reduce_final_output",
        "under TP the runner all-reduces the MoE output over the TP group: each TP rank's rows (zeros elsewhere) "
        "sum to every row, so a rank sends only its share of the tokens",
        uses=("tp_size", "tensor_model_parallel_all_reduce"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.forward_context",
        "ForwardContext",
        "is_padding: the padded rows of the current forward (a DP rank's dummy forward is padding only); the seam "
        "sends only the real rows (RowShare)",
        fields=("is_padding",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.forward_context",
        "is_forward_context_available",
        "RowShare's padding mask: read only inside a forward",
        params=(),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.forward_context",
        "get_forward_context",
        "RowShare's padding mask: the current forward's context (vLLM 0.32's V1 and V2 runners set is_padding; "
        "where a runner sets none every row is sent, a dummy forward's one row too)",
        params=(),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.config.parallel",
        "ParallelConfig",
        "an Attention process's AFD rank: data_parallel_rank * tensor_parallel_size + rank % tensor_parallel_size "
        "(rank: the worker's rank in its engine); admission reads enable_elastic_ep",
        fields=("data_parallel_size", "data_parallel_rank", "tensor_parallel_size", "rank", "enable_elastic_ep"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.v1.engine.core",
        "DPEngineCoreProc.run_busy_loop",
        "a MoE model's DP ranks step in lock-step: a rank without work runs a dummy batch in every step of a wave, "
        "so every rank calls every MoE layer in every step (one FFN computation per layer for the group)",
        uses=("execute_dummy_batch", "_has_global_unfinished_reqs"),
        capability=MOE,
    ),
)

MOE_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        CUSTOM_OP,
        "",
        "the replacement's idempotency reads the OOT registry",
        names=("op_registry_oot",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        CUSTOM_OP,
        "maybe_get_oot_by_class",
        "register_routed_experts() asks who owns RoutedExperts (read-only) before registering",
        params=("class_type",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        CUSTOM_OP,
        "PluggableLayer.__new__",
        "allocates the registered replacement, looked up by the upstream CLASS name",
        uses=("op_registry_oot", "__name__"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        CUSTOM_OP,
        "PluggableLayer.register_oot",
        "registers AfdRoutedExperts under the key 'RoutedExperts' in every vLLM process",
        params=("_decorated_layer_cls", "name"),
        decorators=("classmethod",),
        uses=("op_registry_oot", "__name__"),
        capability=MOE,
    ),
    Seam("vllm", ROUTED, "RoutedExperts", "AfdRoutedExperts subclasses it", bases=("PluggableLayer",), capability=MOE),
    Seam(
        "vllm",
        ROUTED,
        "RoutedExperts.__init__",
        "the replacement is built with upstream's arguments (the Attention role swaps expert_map_manager for an "
        "empty HeldExpertMap first); __init__ asks _get_quant_method, then create_weights (the stand-in's "
        "allocates 0 experts whatever num_experts says)",
        params=("layer_name", "params_dtype", "moe_config", "quant_config", "expert_map_manager"),
        assigns=("quant_method", "expert_map_manager"),
        uses=("_get_quant_method", "create_weights", "weight_loader", "num_local_experts"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        ROUTED,
        "RoutedExperts._get_quant_method",
        "AfdRoutedExperts overrides it: on the Attention role upstream's method (super()) is built and wrapped "
        "by the stand-in",
        params=("prefix", "quant_config", "moe_config"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        ROUTED,
        "RoutedExperts.weight_loader",
        "the loader of the Attention role's 0-expert parameters: an expert the layer's map gives -1 is "
        "skipped (return False), which is every expert under the empty held set",
        params=("param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success"),
        uses=("_map_global_expert_id_to_local_expert_id",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        ROUTED,
        "RoutedExperts.load_weights",
        "calls param.weight_loader per expert, and refuses a checkpoint name whose parameter the layer lacks: "
        "the real method's create_weights (0 experts) makes every name it would",
        params=("weights",),
        uses=("weight_loader",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        ROUTED,
        "RoutedExperts.forward_modular",
        "the MoE runner's call into the seam (Attention: one AFD transfer); the FFN role calls it per item",
        params=TOPK,
        uses=("apply",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        ROUTED,
        "RoutedExperts._ensure_moe_quant_config_init",
        "the runner calls it every forward: it reads the stand-in's get_fused_moe_quant_config",
        params=(),
        uses=("get_fused_moe_quant_config",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        METHOD,
        "FusedMoEMethodBase",
        "the stand-in quant method subclasses it",
        bases=("QuantizeMethodBase",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        METHOD,
        "FusedMoEMethodBase.__init__",
        "the stand-in is built with the layer's moe config; moe_kernel stays None",
        params=("moe",),
        assigns=("moe", "moe_quant_config", "moe_kernel"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        METHOD,
        "FusedMoEMethodBase.create_weights",
        "the stand-in's delegates to the real method's with num_experts=0 (keywords as upstream passes them)",
        params=("layer", "num_experts", "hidden_size", "intermediate_size_per_partition", "params_dtype"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        METHOD,
        "FusedMoEMethodBase.get_fused_moe_quant_config",
        "overridden by the stand-in",
        params=("layer",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        METHOD,
        "FusedMoEMethodBase.apply",
        "overridden by the stand-in: called by forward_modular with these keywords",
        params=("layer", *TOPK),
        capability=MOE,
    ),
    *(
        Seam(
            "vllm",
            METHOD,
            f"FusedMoEMethodBase.{name}",
            "read by the MoE runner, inherited by the stand-in",
            params=(),
            decorators=("property",),
            capability=MOE,
        )
        for name in _RUNNER_READS
    ),
    Seam(
        "vllm",
        METHOD,
        "FusedMoEMethodBase.mk_can_overlap_shared_experts",
        "read by the MoE runner (through SharedExperts); the stand-in overrides it with True: its apply runs "
        "the shared experts itself, after the routed round trip",
        params=(),
        decorators=("property",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        MOE_RUNNER,
        "MoERunner.__init__",
        "the MoE runner asks the quant method whether it overlaps the shared experts (the stand-in says it does)",
        uses=("mk_can_overlap_shared_experts", "SharedExperts"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        MOE_RUNNER,
        "MoERunner._apply_quant_method",
        "the runner hands its SharedExperts to forward_modular (so to the stand-in's apply) and reads their "
        "output only after forward_modular returned",
        uses=("forward_modular", "output"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        SHARED,
        "SharedExpertsOrder",
        "the stand-in's apply runs the shared experts as MK_INTERNAL_OVERLAPPED",
        names=("MK_INTERNAL_OVERLAPPED",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        SHARED,
        "SharedExperts.forward",
        "the stand-in's apply calls shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)",
        params=("shared_experts_input", "order"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        SHARED,
        "SharedExperts._determine_shared_experts_order",
        "forward runs the shared experts only in the order it determines: MK_INTERNAL_OVERLAPPED when the "
        "quant method says mk_can_overlap_shared_experts (else the runner runs them before apply)",
        uses=("_mk_can_overlap_shared_experts", "MK_INTERNAL_OVERLAPPED"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.triton_utils",
        "",
        "the support matrix reads vllm.triton_utils.HAS_TRITON (Model Runner V2 needs Triton)",
        names=("HAS_TRITON",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.model_executor.layers.quantization.base_config",
        "QuantizeMethodBase.process_weights_after_loading",
        "the loader calls it on every quant method; the stand-in's is a no-op",
        params=("layer",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{FUSED_MOE}.config",
        "FusedMoEConfig",
        "the Attention role sizes its transfers from it; has_bias decides the placeholder biases; the refusals "
        "read moe_parallel_config",
        fields=("num_experts", "experts_per_token", "hidden_dim", "has_bias", "moe_parallel_config"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        f"{FUSED_MOE}.config",
        "FusedMoEQuantConfig.make",
        "the stand-in's (unquantized) moe quant config",
        params=(),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.model_executor.utils",
        "set_weight_attrs",
        "attaches the discarding loader to the placeholders of a layer without a held set (vLLM-Ascend's)",
        params=("weight", "weight_attrs"),
        capability=MOE,
    ),
    *HELD_SEAMS,
    *GROUP_SEAMS,
    *LOADER_SEAMS,
    *FFN_MODEL_SEAMS,
    Seam(
        "vllm",
        "vllm.config.vllm",
        "get_current_vllm_config",
        "the replacement reads additional_config['afd'] while vLLM builds the model",
        params=(),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.config.vllm",
        "VllmConfig.use_v2_model_runner",
        "decides whether the V2 runner (capability mrv2) is in use: the layer's validation and the support "
        "matrix read it",
        params=(),
        decorators=("property",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.config.scheduler",
        "SchedulerConfig",
        "bounds the Attention role's transfer buffers (warm-up sends a full batch)",
        fields=("max_num_batched_tokens",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.model_executor.models.utils",
        "extract_layer_index",
        "work items are keyed by the MoE layer index parsed from the layer name",
        params=("layer_name", "num_attn_module"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.entrypoints.llm",
        "LLM.collective_rpc",
        "the FFN role (and the vllm_runtime tests) reach into the worker through it",
        params=("method", "timeout", "args", "kwargs"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.model_executor.layers.fused_moe.modular_kernel",
        "FusedMoEKernelModularImpl.apply",
        "an FFN rank keeps only its block of experts (worker_ext.keep_expert_block): the modular kernel must "
        "take the local expert count from the weights it is handed (local_num_experts = w1.shape[0])",
        uses=("w1", "local_num_experts", "global_num_experts"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.config.parallel",
        "ParallelConfig",
        "--worker-cls / worker_extension_cls select afd-mrv2's worker and the FFN extension",
        fields=("worker_cls", "worker_extension_cls"),
        capability=MOE,
    ),
    *DEPLOYMENT_SEAMS,  # the support matrix on the vLLM path (compat/deployment_seams.py)
    Seam(
        "vllm",
        "vllm.v1.worker.worker_base",
        "WorkerWrapperBase.init_worker",
        "resolves worker_cls and mixes worker_extension_cls into the worker (after the general plugins)",
        params=("all_kwargs",),
        uses=("worker_cls", "worker_extension_cls", "load_general_plugins"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.entrypoints.openai.api_server",
        "",
        "afd-mrv2 serve starts each Attention engine as `python -m vllm.entrypoints.openai.api_server`",
        runnable=True,
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.entrypoints.cli.serve",
        "run_headless",
        "`python -m afd_mrv2.serve.headless` runs an Attention group's engine cores on a node without its front end",
        params=("args",),
        uses=("data_parallel_size_local", "CoreEngineProcManager"),
        capability=DP_NODES,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.cpu_worker",
        "CPUWorker",
        "the CPU Attention worker subclasses it",
        bases=("Worker",),
        capability="mrv2",
        platforms=CPU,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.cpu_worker",
        "CPUWorker.init_device",
        "builds the V2 CPUModelRunner inline (no _make_model_runner on CPU): the worker overrides it and "
        "replaces self.model_runner with the Attention runner built from (vllm_config, self.device)",
        params=(),
        assigns=("device", "model_runner"),
        uses=("use_v2_model_runner", "CPUModelRunner"),
        capability="mrv2",
        platforms=CPU,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.cpu.model_runner",
        "CPUModelRunner",
        "the platform V2 runner on CPU; the Attention runner composes over it",
        bases=("GPUModelRunner",),
        capability="mrv2",
        platforms=CPU,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.gpu_worker",
        "Worker.__init__",
        "AfdWorker (init_device on CPU, _make_model_runner on CUDA) reads self.use_v2_model_runner, assigned here",
        params=("vllm_config", "local_rank", "rank", "distributed_init_method"),
        assigns=("use_v2_model_runner",),
        capability="mrv2",
    ),
)
