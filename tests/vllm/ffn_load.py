"""Build and load the FFN role's model in this process, the way an FFN engine's worker does; report as JSON.

    python tests/vllm/ffn_load.py MODEL OUT.json SPEC [SPEC ...]

Each SPEC is a JSON object ``{"num_ffn_ranks": F, "expert_replicas": R, "rank": f}`` (optionally
``"placement": {"holders": [...]}`` and ``"mode"``): the ``afd`` section of role ``ffn`` the model is built
under.  ``mode`` ``afd`` (default): the experts-only model (``hf_overrides`` ``AfdFfnExperts``) loaded by
the ``afd`` load format, as ``afd_mrv2.mrv2.ffn.role`` starts it; ``plain``: vLLM's own model of the
checkpoint without an ``afd`` section, loaded by vLLM's default loader (the control: what an FFN rank
held before).  The specs run one after another in this process (a world of 1 over gloo); the report
gives each one's held experts, parameter bytes by kind, the checkpoint tensors read, and the process's
peak RSS after it (meaningful for the first spec of a fresh process only).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from afd_mrv2.mrv2 import memory
from afd_mrv2.mrv2.attention.experts import AfdRoutedExperts
from afd_mrv2.mrv2.ffn.model import ARCHITECTURE
from afd_mrv2.procs import peak_rss_bytes
from afd_mrv2.vllm_plugin import register
from tests.vllm.attention_load import YIELDED, CountingAfdLoader


class CountingDefaultLoader(DefaultModelLoader):
    """vLLM's default loader, its reads counted by kind as the ``afd`` format counts them (the control)."""

    def get_all_weights(self, model_config: Any, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in memory.count_read(super().get_all_weights(model_config, model)):
            YIELDED.append(name)
            yield name, tensor


def load(model_dir: str, spec: dict[str, Any], port: int) -> dict[str, Any]:
    mode = spec.pop("mode", "afd")
    afd = {"connector": "torch_p2p", "role": "ffn", "port": port, "num_attention_ranks": 1, **spec}
    quantized = "quantization_config" in json.loads((Path(model_dir) / "config.json").read_text())
    dtype = "bfloat16" if quantized else "float32"
    overrides = {"architectures": [ARCHITECTURE]} if mode == "afd" else {}
    model_config = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, hf_overrides=overrides
    )
    extra = {"additional_config": {"afd": afd}} if mode == "afd" else {}
    cfg = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="afd"), **extra)
    YIELDED.clear()
    with set_current_vllm_config(cfg):
        loader = CountingAfdLoader(cfg.load_config) if mode == "afd" else CountingDefaultLoader(LoadConfig())
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
        loader.load_weights(model, cfg.model_config)
        process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
    memory.record_load(model)
    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    figures = memory.current_memory()
    report = {
        "mode": mode,
        "model_class": type(model).__name__,
        "spec": spec,
        "held": [
            list(m.afd_held) if isinstance(m, AfdRoutedExperts) and m.afd_held is not None else None for m in layers
        ],
        "local_num_experts": [m.local_num_experts for m in layers],
        "expert_map_visible": [m.expert_map is not None for m in layers],
        "parameters": {n: [list(p.shape), str(p.dtype)] for n, p in model.named_parameters()},
        "parameter_bytes": memory.parameter_bytes(model),
        "memory": None if figures is None else figures.as_dict(),
        "yielded": list(YIELDED),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    del model, layers
    return report


def main() -> None:
    model_dir, out, specs = sys.argv[1], sys.argv[2], [json.loads(s) for s in sys.argv[3:]]
    register()  # afd-mrv2's general plugin: its RoutedExperts, the afd load format, the experts-only model
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    reports = [load(model_dir, spec, 29999) for spec in specs]
    Path(out).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
