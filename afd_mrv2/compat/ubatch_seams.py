"""The seams of afd-mrv2's own micro-batch runner over MRV2's ``UBatchRunner`` (capability ``ubatch_runner``).

Part of the seam lists of :mod:`afd_mrv2.compat.seams` (see its docstring for what a
seam is and how it is checked); kept apart because it is the longest list.
"""

from __future__ import annotations

from afd_mrv2.compat.seam import Seam

UBATCH = "vllm.v1.worker.gpu.ubatch_utils"
RUNNER = "vllm.v1.worker.gpu.model_runner"
GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils"
UBATCHING = "vllm.v1.worker.ubatching"
UBATCH_RUNNER = "ubatch_runner"

#: What upstream's ``UBatchRunner.prepare`` reads from ``self`` (besides ``_make_forward_contexts``).
PREPARE_READS = (
    "num_ubatches",
    "ubatch_query_start_loc",
    "ubatch_seq_lens",
    "ubatch_dcp_local_seq_lens",
    "dcp_size",
    "dcp_rank",
    "cp_interleave",
    "model_state",
    "attn_groups",
    "kv_cache_config",
)
#: Every attribute afd-mrv2's micro-batch runner sets in its own constructor instead of calling upstream's
#: (afd_mrv2.mrv2.attention.ubatch_runner.AfdUBatchRunnerMixin.__init__): what upstream's prepare/run/abort_pending_run
#: read, plus what its own _make_forward_contexts and begin_capturable_run read.
UBATCH_ATTRS = (*PREPARE_READS, "vllm_config", "parallel_config", "device", "ready_barrier", "_pending_finish")


#: afd-mrv2's own micro-batch runner over MRV2's (afd_mrv2/mrv2/attention/ubatch_runner.py, split_policy.py, runner.py;
#: capability ``ubatch_runner``).
UBATCH_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner",
        "afd-mrv2's micro-batch runner subclasses it and inherits prepare, run and abort_pending_run",
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.__init__",
        "never called (it builds SM control, CUDA/ROCm only, and two torch.cuda.Stream): afd-mrv2's constructor "
        "sets these attributes itself, for the methods it inherits and its own",
        assigns=UBATCH_ATTRS,
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.prepare",
        "inherited, called by execute_model: it reads only what afd-mrv2's constructor sets, and builds the "
        "forward contexts through _make_forward_contexts (overridden: no DP metadata)",
        params=("input_batch", "block_tables", "slot_mappings", "cg_mode", "for_capture"),
        uses=(*PREPARE_READS, "_make_forward_contexts"),
        self_reads=(*PREPARE_READS, "_make_forward_contexts"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner._make_forward_contexts",
        "overridden: one forward context per micro-batch from create_forward_context without DPMetadata "
        "(DPMetadata.make asserts data parallelism > 1); prepare calls it with these arguments",
        params=("ubatch_slices", "attn_metadata", "slot_mappings_by_layer", "is_padding"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.run",
        "inherited (wrapped for timing): it starts the step through begin_capturable_run, which afd-mrv2 overrides",
        params=("model", "model_inputs", "ubatch_state"),
        uses=("begin_capturable_run",),
        self_reads=("begin_capturable_run",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.begin_capturable_run",
        "overridden (afd-mrv2's thread launcher: device-generic, with a step abort mark); run and graph "
        "capture call it with these arguments",
        params=("model", "model_inputs", "ubatch_state", "for_capture"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchRunner.abort_pending_run",
        "inherited: it releases parked threads through _pending_finish, which afd-mrv2's launcher sets",
        params=(),
        uses=("_pending_finish",),
        self_reads=("_pending_finish",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "UBatchState",
        "prepare returns it; afd-mrv2's launcher reads the slices and the forward contexts",
        fields=("slices", "forward_contexts"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "slice_model_inputs",
        "afd-mrv2's launcher narrows the model inputs to each micro-batch with it",
        params=("model_inputs", "token_slice"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCH,
        "merge_ubatch_outputs",
        "afd-mrv2's launcher reassembles the step's output with it",
        params=("outputs",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.ubatch_utils",
        "UBatchSlice",
        "the launcher slices each micro-batch's inputs by its token_slice",
        fields=("request_slice", "token_slice"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCHING,
        "make_ubatch_contexts",
        "afd-mrv2's launcher builds one UBatchContext per micro-batch with it (keywords)",
        params=("num_micro_batches", "compute_stream", "comm_stream", "forward_contexts", "ready_barrier"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCHING,
        "UBatchContext.__init__",
        "the launcher reads each context's id and starts the first micro-batch with contexts[0].cpu_wait_event",
        assigns=("id", "cpu_wait_event", "cpu_signal_event"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCHING,
        "UBatchContext.__enter__",
        "a micro-batch thread parks at the ready barrier, then waits for its turn: the launcher's "
        "ready_barrier.wait() and cpu_wait_event.set() rely on it",
        uses=("ready_barrier", "cpu_wait_event"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        UBATCHING,
        "UBatchContext.__exit__",
        "leaving a context wakes the next micro-batch (cpu_signal_event): a failed micro-batch marks the step "
        "before its exit, so every sibling wakes, sees the mark and ends",
        uses=("cpu_signal_event",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        "vllm.forward_context",
        "create_forward_context",
        "afd-mrv2's _make_forward_contexts calls create_forward_context(attn_metadata, vllm_config, "
        "slot_mapping=, is_padding=): every other parameter must keep its default (dp_metadata None)",
        params=("attn_metadata", "vllm_config", "slot_mapping", "is_padding"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        "vllm.forward_context",
        "override_forward_context",
        "the launching thread holds override_forward_context(None) until the micro-batch threads joined",
        params=("forward_context",),
        decorators=("contextmanager",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        "vllm.utils.torch_utils",
        "current_stream",
        "the micro-batches' compute stream where the device backend has no native stream (the host backend)",
        params=(),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.utils",
        "AttentionGroup.create_metadata_builders",
        "the Attention runner rebuilds each attention group's metadata builders, one per micro-batch "
        "(prepare hands ubatch_idx to the model state's prepare_attn)",
        params=("vllm_config", "device", "kernel_block_size", "num_metadata_builders"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.initialize_kv_cache",
        "after upstream's, the Attention runner reads these to install micro-batching, and replaces "
        "ubatch_runner and cudagraph_manager (upstream builds no micro-batch runner at DP 1)",
        assigns=("kv_cache_config", "attn_groups", "kernel_block_sizes", "ubatch_runner", "cudagraph_manager"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.__init__",
        "the Attention runner builds afd-mrv2's micro-batch runner (its buffers sized by max_num_reqs), the "
        "metadata builders and the graph manager from these",
        assigns=("vllm_config", "device", "max_num_reqs"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.load_model",
        "model_state goes to afd-mrv2's micro-batch runner (upstream's prepare calls its prepare_attn)",
        assigns=("model_state",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        RUNNER,
        "GPUModelRunner.execute_model",
        "a step is split when the descriptor from dispatch_cg_and_sync_dp has num_ubatches > 1: then it calls "
        "ubatch_runner.prepare and ubatch_runner.run",
        uses=("dispatch_cg_and_sync_dp", "num_ubatches", "ubatch_runner", "prepare", "run"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        "vllm.v1.worker.gpu.dp_utils",
        "dispatch_cg_and_sync_dp",
        "at DP 1 the graph manager's dispatch alone decides the split (afd-mrv2's manager overrides it)",
        uses=("dispatch",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        GRAPHS,
        "ModelCudaGraphManager",
        "afd-mrv2's split policy subclasses it (Afd<ModelCudaGraphManager>) and overrides only dispatch",
        bases=("CudaGraphManager",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        GRAPHS,
        "ModelCudaGraphManager.__init__",
        "the Attention runner rebuilds the manager with these arguments, copied from the one upstream built",
        params=(
            "vllm_config",
            "device",
            "cudagraph_mode",
            "decode_query_len",
            "lora_capture_cases",
            "varlen_decode",
            "ubatch_runner",
        ),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        GRAPHS,
        "CudaGraphManager.__init__",
        "the Attention runner copies these from the manager upstream built into its own",
        assigns=("cudagraph_mode", "decode_query_len", "lora_capture_cases", "varlen_decode", "ubatch_runner"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        GRAPHS,
        "CudaGraphManager.dispatch",
        "overridden: a step asked for with one micro-batch gets the split policy's count, passed on as num_ubatches=",
        params=("num_reqs", "num_tokens", "uniform_token_count", "num_active_loras", "max_query_len", "num_ubatches"),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        GRAPHS,
        "BatchExecutionDescriptor",
        "dispatch's descriptor carries the micro-batch count that execute_model splits on",
        fields=("num_ubatches",),
        capability=UBATCH_RUNNER,
    ),
    Seam(
        "vllm",
        "vllm.config.parallel",
        "ParallelConfig",
        "afd-mrv2's micro-batch runner sets cp_interleave from it, as upstream's constructor does",
        fields=("cp_kv_cache_interleave_size",),
        capability=UBATCH_RUNNER,
    ),
)
