"""The vLLM-Ascend seams: what afd-mrv2 relies on in vllm_ascend (and in vLLM, on Ascend only).

Checked wherever a tree holds ``vllm_ascend`` (the vllm-ascend seams by their distribution,
the vLLM ones by ``platforms={"ascend"}``); the ``blocks`` seams are the upstream facts the
Ascend row's ``ubatch_runner`` refusal cites.  Read in vllm-ascend 0.30.0rc2 (RFC 0005 §1).

See docs/internals/compat.md, "afd_mrv2.compat.ascend_seams".
"""

from __future__ import annotations

from afd_mrv2.compat.seam import Seam

ASCEND = frozenset({"ascend"})
MOE, MRV2, UBATCH = "moe_seam", "mrv2", "ubatch_runner"
WORKER = "vllm_ascend.worker.worker"
RUNNER = "vllm_ascend.worker.v2.model_runner"
ROUTED = "vllm_ascend.ops.fused_moe.routed_experts"
MOE_RUNNER = "vllm_ascend.ops.fused_moe.fused_moe"
COMM = "vllm_ascend.ops.fused_moe.moe_comm_method"
CONTEXT = "vllm_ascend.ascend_forward_context"
A310 = "vllm_ascend._310p.fused_moe.fused_moe"
PATCHED_KV = "vllm_ascend.patch.worker.patch_v2.patch_model_runner"
CUSTOM_OP = "vllm.model_executor.custom_op"
#: the quant-method call forward_impl makes (and the FFN role repeats with the router already run)
APPLY = (
    "fused_experts_results: FusedExpertsResult = self.quant_method.apply(layer=self, x=hidden_states, "
    "topk_weights=topk_weights, topk_ids=topk_ids, shared_experts=None, shared_experts_input=None)"
)
_REGISTERED = "its worker registers it under this name: afd-mrv2's Attention role replaces that entry"

#: The V2 runner on Ascend: the Attention runner composes over NPUModelRunner, built in NPUWorker.init_device.
ASCEND_RUNNER_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm-ascend", RUNNER, "NPUModelRunner", "the Ascend Attention runner subclasses it", bases=("GPUModelRunner",)
    ),
    Seam(
        "vllm-ascend", RUNNER, "NPUModelRunner.__init__", "constructed by the worker", params=("vllm_config", "device")
    ),
    Seam(
        "vllm-ascend",
        RUNNER,
        "NPUModelRunner.initialize_kv_cache",
        "overridden (with *args/**kwargs: vllm-ascend drops is_profiling) to install micro-batching after it",
        params=("kv_cache_config",),
    ),
    Seam(
        "vllm-ascend",
        RUNNER,
        "NPUModelRunner.execute_model",
        "the Attention runner's execute_model calls it as execute_model(scheduler_output, intermediate_tensors, "
        "dummy_run, **kwargs) and then reads execute_model_state (set by upstream's, which it calls)",
        params=("scheduler_output", "intermediate_tensors", "dummy_run"),
        uses=("execute_model",),
        capability=MRV2,
    ),
    Seam(
        "vllm-ascend",
        RUNNER,
        "NPUModelRunner.load_model",
        "the Attention runner's load_model (*args/**kwargs) runs it; it calls upstream's, which assigns self.model",
        uses=("load_model",),
        capability=MRV2,
    ),
    Seam(
        "vllm-ascend",
        WORKER,
        "NPUWorker",
        "AfdWorker on Ascend subclasses it (afd_mrv2.mrv2.attention.worker.afd_init_device_worker_class)",
        capability=MRV2,
    ),
    Seam(
        "vllm-ascend",
        WORKER,
        "NPUWorker.__init__",
        "AfdWorker's init_device reads self.use_v2_model_runner, assigned here",
        assigns=("use_v2_model_runner",),
        capability=MRV2,
    ),
    Seam(
        "vllm-ascend",
        WORKER,
        "NPUWorker.init_device",
        "builds the runner inline (V2: vllm_ascend.worker.v2.model_runner.NPUModelRunner): AfdWorker overrides "
        "it, runs it, then replaces self.model_runner by the Attention runner built from (vllm_config, self.device)",
        params=(),
        assigns=("device", "model_runner"),
        uses=("use_v2_model_runner",),
        capability=MRV2,
    ),
)

#: Who registers vLLM-Ascend's MoE layers, and the registry afd-mrv2's Attention role rewrites one entry of
#: (afd_mrv2/compat/registry.py replace_oot_layer, after NPUWorker.__init__ registered them).
ASCEND_REGISTRY_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm-ascend",
        "vllm_ascend.utils",
        "register_ascend_customop",
        "registers RoutedExperts and MoERunner (AscendRoutedExperts/AscendMoERunner, the 310 variants on 310P) "
        "through CustomOp.register_oot, once: replace_oot_layer expects exactly these classes in the registry",
        params=("vllm_config",),
        entries=(
            ("RoutedExperts", "AscendRoutedExperts"),
            ("MoERunner", "AscendMoERunner"),
            ("RoutedExperts", "AscendRoutedExperts310"),
            ("MoERunner", "AscendMoERunner310"),
        ),
        statements=("CustomOp.register_oot(_decorated_op_cls=op_cls, name=name)",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        WORKER,
        "NPUWorker.__init__",
        "calls register_ascend_customop: after AfdWorker's super().__init__ the RoutedExperts entry is "
        "vLLM-Ascend's, and init_device (before load_model) is where the Attention role replaces it",
        statements=("register_ascend_customop(vllm_config)",),
        capability=MOE,
    ),
    Seam(
        "vllm",
        CUSTOM_OP,
        "",
        "replace_oot_layer reads op_registry_oot['RoutedExperts'] and writes the replacement there",
        names=("op_registry_oot",),
        capability=MOE,
        platforms=ASCEND,
    ),
    Seam(
        "vllm",
        CUSTOM_OP,
        "CustomOp.register_oot",
        "what register_ascend_customop registers with: it writes op_registry_oot[name], asserting no duplicate "
        "(why afd-mrv2 never registers a second RoutedExperts on Ascend)",
        params=("_decorated_op_cls", "name"),
        decorators=("classmethod",),
        uses=("op_registry_oot",),
        capability=MOE,
        platforms=ASCEND,
    ),
    Seam(
        "vllm",
        CUSTOM_OP,
        "PluggableLayer.__new__",
        "RoutedExperts(...) instantiates whatever op_registry_oot['RoutedExperts'] names: the replacement",
        uses=("op_registry_oot", "__name__"),
        capability=MOE,
        platforms=ASCEND,
    ),
)

#: The routed-experts class the Attention adapter subclasses and the FFN role drives.
ASCEND_EXPERTS_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm-ascend",
        ROUTED,
        "AscendRoutedExperts",
        "the Attention adapter is built as a subclass of the class vLLM-Ascend registered (this or the 310 one)",
        bases=("RoutedExperts",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        ROUTED,
        "AscendRoutedExperts.__init__",
        "upstream creates the weights, then an unquantized model gets AscendUnquantizedFusedMoEMethod through "
        "_replace_quant_method: the adapter installs its own method the same way after super().__init__; the "
        "runner later sets router and return_with_event, initialised here",
        assigns=("router", "return_with_event"),
        uses=("_replace_quant_method", "AscendUnquantizedFusedMoEMethod", "quant_config"),
        capability=MOE,
    ),
    Seam(
        "vllm",
        "vllm.model_executor.layers.fused_moe.routed_experts",
        "RoutedExperts._replace_quant_method",
        "the adapter installs AFD's quant method on its own instance with it, as vLLM-Ascend does",
        params=("quant_method",),
        assigns=("quant_method",),
        capability=MOE,
        platforms=ASCEND,
    ),
    Seam(
        "vllm-ascend",
        ROUTED,
        "AscendRoutedExperts._get_quant_method",
        "quantized models take their method from quant_config.get_quant_method (the FFN role keeps it)",
        params=("prefix", "quant_config", "moe_config"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        ROUTED,
        "AscendRoutedExperts.quant_type",
        "read by AscendMoERunner.__init__ and forward_impl's prepare: the adapter's method reports none",
        params=(),
        decorators=("property",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        ROUTED,
        "AscendRoutedExperts.forward_impl",
        "the runner's call into the layer: comm prepare, the router, then quant_method.apply (AFD's transfer on "
        "the Attention role), then comm finalize of result.routed_out; milestones when return_with_event",
        params=("hidden_states", "router_logits", "input_ids"),
        statements=(APPLY,),
        uses=("get_moe_comm_method", "_EXTRA_CTX", "moe_comm_type", "_select_experts", "finalize", "routed_out"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        ROUTED,
        "AscendUnquantizedFusedMoEMethod.apply",
        "the FFN role calls it per received item with forward_impl's keywords; it runs the comm method's "
        "fused_experts and returns a FusedExpertsResult",
        params=("layer", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input"),
        uses=("_EXTRA_CTX", "moe_comm_method", "fused_experts"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        A310,
        "AscendRoutedExperts310",
        f"the 310P RoutedExperts ({_REGISTERED}; the adapter subclasses it there)",
        bases=("AscendRoutedExperts",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        A310,
        "AscendRoutedExperts310.__init__",
        "on 310P the unquantized method is installed by _replace_quant_method after the parent's: the adapter's "
        "own runs after both",
        uses=("_replace_quant_method",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        A310,
        "AscendMoERunner310",
        "the 310P MoERunner (registered under MoERunner there); both roles keep it",
        bases=("AscendMoERunner",),
        capability=MOE,
    ),
)

#: The MoE runner, the comm methods and the forward context (the FFN role enters it per item).
ASCEND_FORWARD_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm-ascend",
        MOE_RUNNER,
        "AscendMoERunner",
        "vLLM-Ascend's MoERunner (registered under MoERunner); both roles keep it",
        bases=("MoERunner",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        MOE_RUNNER,
        "AscendMoERunner.__init__",
        "hands the layer its router, with shared experts asks it for milestones (return_with_event), and sets "
        "up the comm methods get_moe_comm_method later returns",
        statements=("self.routed_experts.router = router", "routed_experts.return_with_event = True"),
        uses=("setup_moe_comm_method", "quant_type"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        MOE_RUNNER,
        "AscendMoERunner._forward_impl",
        "calls forward_impl with these keywords (never upstream's forward_modular); with shared experts it "
        "expects (routed_out, RoutedMoEMilestones)",
        params=("hidden_states", "router_logits", "shared_experts_input", "input_ids"),
        statements=(
            "return self.routed_experts.forward_impl(hidden_states=hidden_states, router_logits=router_logits, "
            "input_ids=input_ids)",
        ),
        uses=("RoutedMoEMilestones",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        "vllm_ascend.ops.fused_moe.dataclass.shared_experts",
        "RoutedMoEMilestones",
        "forward_impl builds it from the result's events (the Attention adapter leaves them None)",
        fields=("routed_dispatch_start", "shared_activation_overlap_start", "routed_combine_start"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        COMM,
        "FusedExpertsResult",
        "the Attention adapter's apply returns FusedExpertsResult(routed_out=...), every event left at None; the "
        "FFN role reads routed_out",
        fields=(
            "routed_out",
            "before_dispatch_evt",
            "before_gmm2_evt",
            "before_combine_evt",
            "shared_activation_overlap_start_evt",
            "group_list_type",
            "expert_tokens",
        ),
        decorators=("dataclass",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        COMM,
        "get_moe_comm_method",
        "the FFN role sets _EXTRA_CTX.moe_comm_method = get_moe_comm_method(type, moe_config), as forward_impl does",
        params=("moe_comm_type", "moe_config"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        COMM,
        "setup_moe_comm_method",
        "AscendMoERunner.__init__ fills the comm methods per moe_config (ALLGATHER always)",
        params=("moe_config",),
        uses=("ALLGATHER",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        CONTEXT,
        "set_ascend_forward_context",
        "the FFN role enters it per received item: it selects the MoE comm type and stores it on the context",
        params=("attn_metadata", "vllm_config", "num_tokens"),
        decorators=("contextmanager",),
        uses=("select_moe_comm_method", "moe_comm_type", "moe_comm_method"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        CONTEXT,
        "select_moe_comm_method",
        "without expert parallelism (or an EP group of 1) it selects ALLGATHER: the FFN role's EP-1 start",
        params=("num_tokens", "vllm_config"),
        statements=("moe_comm_type = MoECommType.ALLGATHER",),
        uses=("enable_expert_parallel",),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        CONTEXT,
        "",
        "the MoE code reads the comm type and method through the _EXTRA_CTX proxy",
        names=("_EXTRA_CTX", "MoECommType"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        CONTEXT,
        "_ExtraForwardContextProxy",
        "the FFN role sets _EXTRA_CTX.moe_comm_type and .moe_comm_method, and forward_impl reads in_profile_run: "
        "the proxy accepts only the names its extra_attrs lists",
        names=("extra_attrs",),
        literals=("moe_comm_type", "moe_comm_method", "in_profile_run"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        CONTEXT,
        "_ExtraForwardContextProxy.__setattr__",
        "under the V2 runner the proxy stores into the forward context's additional_kwargs",
        uses=("check_extra_attr", "additional_kwargs"),
        capability=MOE,
    ),
    Seam(
        "vllm-ascend",
        "vllm_ascend.platform",
        "NPUPlatform.set_additional_forward_context",
        "under the V2 runner every forward context gets the comm type and method from here",
        entries=(("moe_comm_type", "moe_comm_type"), ("moe_comm_method", "moe_comm_method")),
        capability=MOE,
    ),
)

#: Micro-batching on Ascend: the patched KV-cache initialisation (the micro-batch seams re-checked against
#: it) and the facts that keep ``ubatch_runner`` from the Ascend row (``blocks``).
ASCEND_UBATCH_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm-ascend",
        PATCHED_KV,
        "",
        "vLLM-Ascend replaces GPUModelRunner.initialize_kv_cache by its own: that is what the Attention "
        "runner's super().initialize_kv_cache reaches (through NPUModelRunner's)",
        statements=("upstream.GPUModelRunner.initialize_kv_cache = initialize_kv_cache",),
        capability=MRV2,
    ),
    Seam(
        "vllm-ascend",
        PATCHED_KV,
        "initialize_kv_cache",
        "after it, the Attention runner reads these to install micro-batching, as after upstream's; it still "
        "builds upstream's ubatch runner (maybe_build_ubatch_runner) and passes it to the graph manager",
        params=("self", "kv_cache_config"),
        assigns=("kv_cache_config", "attn_groups", "kernel_block_sizes", "ubatch_runner", "cudagraph_manager"),
        uses=("maybe_build_ubatch_runner", "ModelCudaGraphManager"),
        capability=UBATCH,
    ),
    Seam(
        "vllm-ascend",
        "vllm_ascend.platform",
        "_fix_incompatible_config",
        "the platform switches DBO off: enable_dbo reset to False, ubatch_size to 0",
        statements=(
            "vllm_config.parallel_config.enable_dbo = False",
            "vllm_config.parallel_config.ubatch_size = 0",
        ),
        blocks=UBATCH,
    ),
    *(
        Seam(
            "vllm-ascend",
            f"vllm_ascend.worker.v2.model_states.{module}",
            f"{cls}.prepare_attn",
            "the model state builds attention metadata for micro-batch 0 only (upstream's UBatchRunner.prepare "
            "calls it with ubatch_idx=i)",
            statements=("assert ubatch_idx == 0",),
            blocks=UBATCH,
        )
        for module, cls in (("default", "AscendModelState"), ("mamba_hybrid", "AscendMambaHybridModelState"))
    ),
)

#: What ``afd-mrv2 probe ascend``'s registration child (afd_mrv2/probe/ascend_registration.py) runs: a worker's
#: start-up steps in one fresh process, under a current VllmConfig.
ASCEND_PROBE_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        "vllm.config",
        "",
        "the probe's registration child builds a VllmConfig and makes it current around a worker's steps",
        names=("VllmConfig", "set_current_vllm_config"),
        platforms=ASCEND,
    ),
    Seam(
        "vllm",
        "vllm.plugins",
        "load_general_plugins",
        "the probe's registration child loads the general plugins as WorkerWrapperBase.init_worker does",
        params=(),
        platforms=ASCEND,
    ),
    Seam(
        "vllm",
        "vllm.platforms",
        "",
        "the probe's registration child reports the platform vLLM resolved (vLLM-Ascend's NPUPlatform)",
        names=("current_platform",),
        platforms=ASCEND,
    ),
)

ASCEND_SEAMS: tuple[Seam, ...] = (
    ASCEND_RUNNER_SEAMS
    + ASCEND_REGISTRY_SEAMS
    + ASCEND_EXPERTS_SEAMS
    + ASCEND_FORWARD_SEAMS
    + ASCEND_UBATCH_SEAMS
    + ASCEND_PROBE_SEAMS
)
