"""Build (and load) one vLLM model in this process, the way an Attention engine's worker does; report as JSON.

    python tests/vllm/attention_load.py MODEL MODE OUT.json [PORT]

MODE ``plain``: no ``afd`` section, the model is built only (the real quant method's parameters, E experts).
MODE ``afd``: the ``afd`` section of role ``attention`` (afd-mrv2's general plugin registered), built and
loaded by the ``afd`` load format's loader.  MODE ``placeholders``: role ``attention`` with the stand-in
built without the real method (the placeholders afd-mrv2 had before RFC 0006 item 3, which vLLM-Ascend's
layer still gets), loaded by vLLM's default loader: a quantized checkpoint fails there (pinned).
The loaders here are subclasses that count what the weights iterator yields (no upstream code is patched).
A world of 1 over gloo, ``set_current_vllm_config``; ``BaseModelLoader.load_model``'s steps without its
``torch.accelerator.empty_cache()``, which raises on a machine without an accelerator.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import set_default_torch_dtype

from afd_mrv2.mrv2.attention.standin import RemoteExpertsMethod
from afd_mrv2.mrv2.loader import AfdModelLoader
from afd_mrv2.vllm_plugin import register

EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\..*\.weight$")  # a routed expert's weight (not its scales)
YIELDED: list[str] = []


class CountingAfdLoader(AfdModelLoader):
    def get_all_weights(self, model_config: Any, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().get_all_weights(model_config, model):
            YIELDED.append(name)
            yield name, tensor


class CountingDefaultLoader(DefaultModelLoader):
    def get_all_weights(self, model_config: Any, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().get_all_weights(model_config, model):
            YIELDED.append(name)
            yield name, tensor


class PlaceholderExperts(RoutedExperts):
    """The Attention layer as it was before RFC 0006 item 3: every expert local, the placeholder stand-in."""

    def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        return RemoteExpertsMethod(moe_config, extract_layer_index(prefix))


def layer_report(model: torch.nn.Module) -> dict[str, Any]:
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, RoutedExperts)}
    first = next(iter(layers.values()))
    method = first.quant_method
    real = method.real if isinstance(method, RemoteExpertsMethod) else None
    return {
        "layer_class": type(first).__name__,
        "quant_method": type(method).__name__,
        "real_method": type(real).__name__ if real is not None else None,
        "local_num_experts": [layer.local_num_experts for layer in layers.values()],
        "expert_map": first._expert_map.tolist() if first._expert_map is not None else None,
        "params": {
            name: {n: [list(p.shape), str(p.dtype), p.numel()] for n, p in layer.named_parameters()}
            for name, layer in layers.items()
        },
        "routed_expert_bytes": sum(p.numel() * p.element_size() for m in layers.values() for p in m.parameters()),
    }


def build(model_dir: str, mode: str, port: int) -> tuple[VllmConfig, Any, torch.nn.Module]:
    afd = {"connector": "torch_p2p", "role": "attention", "port": port}
    extra = {} if mode == "plain" else {"additional_config": {"afd": afd}}
    load = LoadConfig(load_format="afd" if mode == "afd" else "auto")
    quantized = "quantization_config" in json.loads((Path(model_dir) / "config.json").read_text())
    dtype = "bfloat16" if quantized else "float32"  # the FP8 copy's activations; the tiny checkpoint's own
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype)
    cfg = VllmConfig(model_config=model_config, load_config=load, **extra)
    if mode == "placeholders":
        RoutedExperts.register_oot(PlaceholderExperts)
    else:
        register()  # afd-mrv2's general plugin: AfdRoutedExperts and the afd load format
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
        registered = type(get_model_loader(cfg.load_config)).__name__
        loader = CountingAfdLoader(cfg.load_config) if mode == "afd" else CountingDefaultLoader(cfg.load_config)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
    return cfg, (loader, registered), model


def main() -> None:
    model_dir, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    port = int(sys.argv[4]) if len(sys.argv) > 4 else 29999
    cfg, (loader, registered), model = build(model_dir, mode, port)
    report: dict[str, Any] = {"mode": mode, "registered_loader": registered, **layer_report(model)}
    if mode != "plain":
        try:
            with set_current_vllm_config(cfg):
                loader.load_weights(model, cfg.model_config)
                process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
            report["loaded"] = True
            report |= layer_report(model)  # after loading and processing
        except (AttributeError, KeyError, ValueError, RuntimeError) as exc:  # the pinned failure is reported
            report["loaded"] = False
            report["error"] = f"{type(exc).__name__}: {exc}"
            report["traceback"] = traceback.format_exc()
        report["tensors_yielded"] = len(YIELDED)
        report["expert_weights_yielded"] = sorted(n for n in YIELDED if EXPERT_WEIGHT.search(n))
        report["expert_tensors_yielded"] = sorted(n for n in YIELDED if ".experts." in n and "shared" not in n)
        report["loader_local_expert_ids"] = (
            sorted(loader.local_expert_ids) if loader.local_expert_ids is not None else None
        )
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
