"""The FFN role's model: the checkpoint's routed experts and nothing else (:class:`AfdFfnExperts`).

An attention-free vLLM model (``is_attention_free``: vLLM gives it no KV cache and runs no memory
profile) that builds one routed-experts layer per MoE layer of the checkpoint, with vLLM's own
``FusedMoEFactory`` and the checkpoint's quant config, under the layer names the checkpoint uses.
afd-mrv2's ``RoutedExperts`` gives each layer the FFN rank's held set, so it allocates exactly those
experts; the ``afd`` load format reads only them.  No attention, embedding, lm_head, norm, router gate
or shared expert exists here: ``load_weights`` drops every other tensor.  Selected by the FFN role
with ``hf_overrides={"architectures": [ARCHITECTURE]}``; registered by the general plugin.
See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.ffn.model".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
from vllm.model_executor.models.registry import ModelRegistry

from afd_mrv2.architectures import experts_layer_args, experts_prefix, moe_layer_indices

#: the architecture name the FFN role selects (``hf_overrides``) and the plugin registers
ARCHITECTURE = "AfdFfnExperts"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class AfdFfnExperts(nn.Module):
    """The routed experts of every MoE layer of the checkpoint; see the module docstring."""

    is_attention_free: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        del prefix  # the layers are named as the checkpoint names them
        model_config = vllm_config.model_config
        hf = model_config.hf_config.to_dict()
        args = experts_layer_args(hf)
        self.hidden_size: int = args["hidden_size"]
        self.vocab_size: int = model_config.get_vocab_size()
        self.dtype: torch.dtype = model_config.dtype
        #: decoder layer index -> the name prefix of its routed experts in the checkpoint
        self.prefixes = {i: experts_prefix(hf, i) for i in moe_layer_indices(hf)}
        self.layers = nn.ModuleDict(
            {
                str(i): FusedMoEFactory(**args, quant_config=vllm_config.quant_config, prefix=name)
                for i, name in self.prefixes.items()
            }
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=input_ids.device)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Zeros: vLLM's own start-up forwards (profile, warm-up) touch no expert; the FFN server computes."""
        return torch.zeros(positions.shape[-1], self.hidden_size, dtype=self.dtype, device=positions.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden_states.shape[0], self.vocab_size, dtype=self.dtype, device=hidden_states.device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each routed-experts tensor to its layer (upstream's per-expert loader, which skips experts this rank
        does not hold); every other tensor is dropped.  Returns the parameter names loaded."""
        loaded: set[str] = set()
        for name, tensor in weights:
            match = _LAYER.match(name)
            index = int(match.group(1)) if match else -1
            layer_prefix = self.prefixes.get(index)
            if layer_prefix is None or not name.startswith(layer_prefix + "."):
                continue  # attention, embeddings, norms, gates, shared experts, lm_head, MTP layers
            runner: Any = self.layers[str(index)]  # vLLM's MoERunner
            for loaded_name in runner.load_weights([(name[len(layer_prefix) + 1 :], tensor)]):
                loaded.add(f"layers.{index}.{loaded_name}")
        return loaded


_registered = False


def register_ffn_model() -> str:
    """Register :class:`AfdFfnExperts` with vLLM's model registry as :data:`ARCHITECTURE`, once per process."""
    global _registered
    if _registered:
        return "already registered"
    ModelRegistry.register_model(ARCHITECTURE, AfdFfnExperts)
    _registered = True
    return "registered"
