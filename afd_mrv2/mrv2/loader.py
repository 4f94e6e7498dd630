"""The ``afd`` load format: vLLM's safetensors loader reading only the routed experts the model holds.

:class:`AfdModelLoader` is vLLM's ``DefaultModelLoader`` (lazy safetensors) whose local-expert filter
is the union of the model's held sets (:func:`afd_mrv2.mrv2.held.held_experts`): on the Attention role
the empty set, so no routed-expert weight tensor is read.  A model without held sets loads as with
``--load-format safetensors``.  It counts the bytes it reads and the model then holds, by kind
(:func:`afd_mrv2.mrv2.memory.current_memory`).  Registered by the general plugin (:func:`register_afd_load_format`).
See docs/rfc/0006-per-role-weights.md, section 1 (b).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from afd_mrv2.errors import ConfigError
from afd_mrv2.mrv2.held import held_experts
from afd_mrv2.mrv2.memory import count_read, record_load

LOAD_FORMAT = "afd"
#: the only safetensors strategy that filters before reading (eager/prefetch read every byte first)
STRATEGY = "lazy"


def _refuse(load_config: Any) -> None:
    """One line for a load option that would read every routed expert despite the filter."""
    strategy = load_config.safetensors_load_strategy
    if strategy not in (None, STRATEGY):
        raise ConfigError(
            "safetensors_load_strategy",
            f"{strategy!r} reads every tensor before the expert filter; --load-format {LOAD_FORMAT} reads lazily "
            "(leave it unset or 'lazy')",
        )
    extra = load_config.model_loader_extra_config
    if isinstance(extra, dict) and extra.get("enable_multithread_load"):
        raise ConfigError(
            "model_loader_extra_config.enable_multithread_load",
            f"the multi-threaded iterator ignores the expert filter; --load-format {LOAD_FORMAT} loads on one thread",
        )


class AfdModelLoader(DefaultModelLoader):
    """``DefaultModelLoader`` over a copy of the load config (``safetensors``, ``lazy``): the base picks
    its file patterns by ``load_format`` and knows no plugin's name."""

    def __init__(self, load_config: Any) -> None:
        _refuse(load_config)
        super().__init__(
            dataclasses.replace(load_config, load_format="safetensors", safetensors_load_strategy=STRATEGY)
        )
        self.held: frozenset[int] | None = None

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        self.held = held_experts(model)  # decided by the layers, as they were built for this role
        super().load_weights(model, model_config)

    def load_model(self, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        model: torch.nn.Module = super().load_model(vllm_config, model_config, *args, **kwargs)
        record_load(model)  # after the quant method's processing: what the process holds
        return model

    def get_all_weights(self, model_config: Any, model: torch.nn.Module) -> Any:
        """Upstream's iterator, each tensor's bytes counted by kind as it is read (:mod:`afd_mrv2.mrv2.memory`)."""
        return count_read(super().get_all_weights(model_config, model))

    def _init_ep_weight_filter(self, model_config: Any) -> None:
        if self.held is None:
            super()._init_ep_weight_filter(model_config)
            return
        self.local_expert_ids = set(self.held)


_registered = False


def register_afd_load_format() -> str:
    """Register :class:`AfdModelLoader` as vLLM's load format ``afd``, once per process."""
    global _registered
    if _registered:
        return "already registered"
    register_model_loader(LOAD_FORMAT)(AfdModelLoader)
    _registered = True
    return "registered"
