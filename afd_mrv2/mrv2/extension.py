"""Methods afd-mrv2 adds to vLLM's worker, reachable through ``collective_rpc``.

:class:`AfdWorkerExtension`: ``afd_ffn_serve``, ``afd_routed_expert_bytes``,
``afd_attention_stats``, ``afd_runner_info``.

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.extension".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.models.utils import extract_layer_index

from afd_mrv2 import envs
from afd_mrv2.compat.detect import detect_runtime
from afd_mrv2.mrv2.attention.experts import AfdRoutedExperts
from afd_mrv2.mrv2.attention.remote import attached
from afd_mrv2.mrv2.attention.runner import AfdAttentionRunnerMixin, runner_info
from afd_mrv2.mrv2.deployment import admit, check_layers
from afd_mrv2.mrv2.ffn.leader import leader_pid, watch_role_leader
from afd_mrv2.mrv2.ffn.server import ExpertsFn, ffn_serving_config, serve_ffn
from afd_mrv2.mrv2.memory import current_memory
from afd_mrv2.mrv2.platforms.ffn import ffn_adapter
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.topology import Topology
from afd_mrv2.validation import afd_section


def routed_experts_layers(model: torch.nn.Module) -> list[RoutedExperts]:
    """The model's routed-experts layers, in model-layer order."""
    layers = {extract_layer_index(m.layer_name): m for m in model.modules() if isinstance(m, RoutedExperts)}
    return [layers[index] for index in sorted(layers)]


def _modular(layer: RoutedExperts) -> ExpertsFn:
    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = layer.forward_modular(x, topk_weights, topk_ids)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{layer.layer_name}: forward_modular returned {type(out).__name__}, not a finished tensor")
        return out

    return run


def allow_amx() -> None:
    """Ask Linux for this process's AMX tiles, where the CPU has them.  vLLM's CPU MoE kernel (its ``amx`` isa,
    chosen for bf16 on such CPUs) runs tile instructions, which the kernel allows a process only after it asked
    (``arch_prctl`` XTILEDATA; SIGILL otherwise).  oneDNN asks on its first AMX matmul; an FFN rank holds only
    experts and never runs one, so its first MoE call died of SIGILL ("Illegal instruction") before this."""
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def _check_held_layers(layers: Sequence[RoutedExperts], held: Sequence[int]) -> None:
    """Every layer holds exactly ``held``, as ``afd.placement`` gives this rank: the layers were built with its
    held set (afd-mrv2's ``RoutedExperts``), or hold every expert where this rank holds them all (a platform
    whose own layer keeps every expert, which its adapter admits only for a whole share)."""
    for layer in layers:
        built = layer.afd_held if isinstance(layer, AfdRoutedExperts) else None
        total = layer.moe_config.num_experts
        if tuple(built if built is not None else range(total)) != tuple(held):
            raise RuntimeError(
                f"{layer.layer_name}: holds experts {list(built) if built is not None else 'all'}, but afd.placement "
                f"gives this FFN rank {list(held)}"
            )


class AfdWorkerExtension:
    """Mixed into vLLM's worker class; see docs/internals/vllm-roles.md."""

    # provided by the vLLM worker this class is mixed into
    vllm_config: Any
    model_runner: Any

    def afd_ffn_serve(self) -> dict[str, Any]:
        raw = afd_section(self.vllm_config.additional_config)
        if not isinstance(raw, Mapping):
            raise RuntimeError(
                "afd_ffn_serve: this engine has no afd section of role ffn (in additional_config['afd'] or "
                f"${envs.ADDITIONAL_CONFIG.name})"
            )
        config = ffn_serving_config(raw)
        admit(self.vllm_config)  # the one admission call, before serve_ffn opens the link
        layers = routed_experts_layers(self.model_runner.get_model())
        check_layers(config, self.vllm_config, layers)  # the MODEL checks, on the layers vLLM really built
        moe = layers[0].moe_config
        topology = Topology.over(config.num_attention_ranks, config.placement_for(moe.num_experts))
        held = topology.held_by(config.rank)
        adapter = ffn_adapter(detect_runtime().platform)  # the platform table: None where forward_modular serves
        if adapter is not None:
            adapter.check_held(held, moe.num_experts)
        _check_held_layers(layers, held)
        compute = [
            _modular(layer) if adapter is None else adapter.routed_experts_fn(layer, self.vllm_config)
            for layer in layers
        ]
        first = next(layers[0].parameters())
        if first.device.type == "cpu":
            allow_amx()
        # started by ffn_role: end with that process while serving (mrv2.leader)
        watch = watch_role_leader(leader_pid(self.vllm_config.additional_config))
        try:
            report = serve_ffn(
                config,
                compute,
                MoeShape(moe.hidden_dim, moe.experts_per_token, moe.num_experts),
                max_tokens=self.vllm_config.scheduler_config.max_num_batched_tokens,
                dtype=self.vllm_config.model_config.dtype,
                device=first.device,
                index=config.rank,
                local_experts_only=True,
            )
        finally:
            if watch is not None:
                watch.stop()
        summary = report.as_dict()
        summary["quant_methods"] = sorted({type(layer.quant_method).__name__ for layer in layers})
        summary["routed_expert_bytes"] = self.afd_routed_expert_bytes()
        summary["model_class"] = type(self.model_runner.get_model()).__name__
        summary["kv_cache_blocks"] = self.vllm_config.cache_config.num_gpu_blocks
        memory = current_memory()
        summary["memory"] = None if memory is None else memory.as_dict()
        return summary

    def afd_routed_expert_bytes(self) -> int:
        layers = routed_experts_layers(self.model_runner.get_model())
        return sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())

    def afd_runner_info(self) -> dict[str, Any]:
        return runner_info(self.model_runner, self)

    def afd_attention_stats(self) -> dict[str, Any] | None:
        remote = attached()
        if remote is None:
            return None
        stats = remote.stats()
        if isinstance(self.model_runner, AfdAttentionRunnerMixin):
            stats["runner"] = self.model_runner.afd_runner_stats()
        return stats
