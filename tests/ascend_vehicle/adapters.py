"""The Ascend MoE adapters on vllm-ascend's real layer, in one fresh process (the CPU vehicle).

Run by ``tests/ascend_vehicle/test_adapters.py`` with the vehicle's interpreter and ``PYTHONPATH`` = the NPU
stubs and the unpacked vllm-ascend 0.30.0rc2 sdist; prints one ``VEHICLE {json}`` line: for each stage, what
real code returned or the exception it stopped at (type, message, the vllm/vllm_ascend frame).

Stages: afd-mrv2's ``place_own_keys`` (the ``afd`` section to ``$AFD_MRV2_ADDITIONAL_CONFIG``), vLLM's
``load_general_plugins`` (vllm-ascend's patches: its ``FusedMoEFactory``), vllm-ascend's
``register_ascend_customop`` then afd-mrv2's ``install_attention_layer`` (the worker's order), ``init_ascend_config``
(refusing the section in ``additional_config``, passing it through the environment) and afd-mrv2's readers,
a gloo world of one with vLLM's and vllm-ascend's model-parallel groups, then MoE layers built by the patched
factory on CPU tensors: the Attention adapter over ``AscendRoutedExperts`` (``forward_impl`` with vllm-ascend's
own router, and with Llama 4's custom routing function, whose router is plain torch), and the FFN compute on
vllm-ascend's own layer.  The FFN peer is :class:`FakePeer` (docstring); nothing else is faked here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

HIDDEN, EXPERTS, TOP_K, TOKENS = 64, 4, 2, 3
PREFIX = "model.layers.0.mlp.experts"


class FakePeer:
    """Stands in for the FFN peer at the transfer's boundary (``afd_mrv2.mrv2.attention.remote``'s process
    session, which ``attach`` returns): records the layers and the calls, answers ``2 * x`` (a linear map the
    test can check rows against).  A real peer needs a second vLLM-Ascend process and an NPU."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.layers: dict[int, Any] = {}
        self.calls: list[dict[str, Any]] = []

    def add_layer(self, layer_index: int, shape: Any) -> None:
        self.layers[layer_index] = shape

    def exchange(self, layer_index: int, x: Any, topk_weights: Any, topk_ids: Any) -> Any:
        self.calls.append(
            {"layer": layer_index, "x": list(x.shape), "ids": topk_ids.tolist(), "weights": topk_weights.tolist()}
        )
        return x * 2.0


def _stopped(exc: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    upstream = [f for f in frames if "/vllm_ascend/" in f.filename or "/vllm/" in f.filename]
    last = upstream[-1] if upstream else frames[-1]
    where = last.filename.split("/vllm_ascend/")[-1] if "/vllm_ascend/" in last.filename else last.filename
    return {
        "type": type(exc).__name__,
        "message": " | ".join(str(exc).splitlines()[:2])[:300],
        "at": f"{where}:{last.lineno}",
    }


def _stage(out: dict[str, Any], name: str, fn: Any) -> Any:
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the vehicle reports where real code stopped
        out[name] = {"stopped": _stopped(exc)}
        return None
    out[name] = {"ok": value if isinstance(value, (str, int, float, bool, list, dict)) else repr(value)[:200]}
    return value


def _vllm_config(additional_config: dict[str, Any] | None = None) -> Any:
    from vllm.config import ModelConfig, VllmConfig

    from afd_mrv2.checkpoints.archs import ModelShape, config_json

    folder = Path(tempfile.mkdtemp())
    shape = ModelShape("mixtral", layers=1, hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K)
    (folder / "config.json").write_text(json.dumps(config_json(shape)))
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", enforce_eager=True)
    return VllmConfig(model_config=model, additional_config=additional_config or {})


def _groups(vllm_config: Any) -> str:
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel

    init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
    ensure_model_parallel_initialized(1, 1)
    init_ascend_model_parallel(vllm_config.parallel_config, vllm_config.engram_config)
    return "gloo world of 1: vLLM's TP/PP/DP/EP groups and vllm-ascend's"


def _layer(routed_experts_cls: type | None, prefix: str = PREFIX, **kwargs: Any) -> Any:
    import torch
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory  # vllm-ascend's patch replaced it

    return FusedMoEFactory(
        num_experts=EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        params_dtype=torch.float32,
        prefix=prefix,
        routed_experts_cls=routed_experts_cls,
        **kwargs,
    )


def _describe(layer: Any) -> dict[str, Any]:
    routed = layer.routed_experts
    return {
        "runner": type(layer).__qualname__,
        "routed": [c.__qualname__ for c in type(routed).__mro__[:3]],
        "quant_method": type(routed.quant_method).__qualname__,
        "router": type(routed.router).__qualname__,
        "expert_elements": sum(p.numel() for p in routed.parameters()),
    }


def _attention_stages(out: dict[str, Any], vllm_config: Any, registered: type, peer: FakePeer) -> None:
    import torch
    from vllm.model_executor.models.llama4 import Llama4MoE
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context

    from afd_mrv2.mrv2.platforms.ascend.attention import AscendRemoteExpertsMethod, attention_layer_class
    from afd_mrv2.mrv2.platforms.ascend.attention import check_unit_layout as check
    from afd_mrv2.mrv2.shape import MoeShape

    def method(prefix: str, moe: Any) -> AscendRemoteExpertsMethod:  # remote_experts_method less admit/attach
        check(moe)
        index = int(prefix.split(".")[2])
        peer.add_layer(index, MoeShape(moe.hidden_dim, moe.experts_per_token, moe.num_experts))
        return AscendRemoteExpertsMethod(moe, index)

    vehicle_cls = attention_layer_class(registered, method)
    seeded = torch.Generator().manual_seed(0)  # torch.manual_seed would seed the (stubbed) npu device too
    x, logits = torch.randn(TOKENS, HIDDEN, generator=seeded), torch.randn(TOKENS, EXPERTS, generator=seeded)
    out["logits_topk"] = torch.topk(logits, TOP_K, dim=-1).indices.tolist()

    def is_peer_answer(result: Any) -> bool:  # the routed output is the peer's, through finalize unchanged
        return bool(torch.equal(result, x * 2.0))

    layer = _stage(out, "attention_layer", lambda: _layer(vehicle_cls))
    if layer is None:
        return
    out["attention_layer"]["ok"] = _describe(layer)
    _stage(
        out,
        "attention_weights_after_loading",
        lambda: layer.routed_experts.quant_method.process_weights_after_loading(layer.routed_experts),
    )
    with set_ascend_forward_context(None, vllm_config, num_tokens=TOKENS):
        _stage(
            out,
            "forward_impl_ascend_router",
            lambda: layer.routed_experts.forward_impl(hidden_states=x, router_logits=logits),
        )
    custom = _stage(
        out,
        "custom_routing_layer",
        lambda: _layer(
            vehicle_cls, custom_routing_function=Llama4MoE.custom_routing_function, prefix="model.layers.1.mlp.experts"
        ),
    )
    if custom is None:
        return
    out["custom_routing_layer"]["ok"] = _describe(custom)
    with set_ascend_forward_context(None, vllm_config, num_tokens=TOKENS):
        _stage(
            out,
            "forward_impl",
            lambda: is_peer_answer(custom.routed_experts.forward_impl(hidden_states=x, router_logits=logits)),
        )
        _stage(out, "runner_forward_impl", lambda: is_peer_answer(custom._forward_impl(x, logits, None)))
        _stage(out, "runner_forward", lambda: is_peer_answer(custom(x, logits)))
    out["peer_calls"] = peer.calls
    out["peer_layers"] = sorted(peer.layers)


def _ffn_stages(out: dict[str, Any], vllm_config: Any) -> None:
    import torch
    from vllm_ascend.ops.fused_moe.routed_experts import AscendRoutedExperts

    from afd_mrv2.mrv2.platforms.ascend.ffn import check_held, routed_experts_fn

    layer = _stage(out, "ffn_layer", lambda: _layer(AscendRoutedExperts, prefix="model.layers.2.mlp.experts"))
    if layer is None:
        return
    out["ffn_layer"]["ok"] = _describe(layer)
    _stage(out, "ffn_check_held_all", lambda: check_held(range(EXPERTS), EXPERTS))
    _stage(out, "ffn_check_held_half", lambda: check_held(range(EXPERTS // 2), EXPERTS))
    routed = layer.routed_experts
    _stage(out, "ffn_weights_after_loading", lambda: routed.quant_method.process_weights_after_loading(routed))
    compute = routed_experts_fn(routed, vllm_config)
    x = torch.randn(TOKENS, HIDDEN)
    ids = torch.tensor([[0, 1]] * TOKENS, dtype=torch.int32)
    _stage(out, "ffn_compute", lambda: list(compute(x, torch.full((TOKENS, TOP_K), 0.5), ids).shape))


def _place_own_keys(out: dict[str, Any]) -> dict[str, Any]:
    """What serve and the FFN role do for an engine on this platform (detected for real): afd-mrv2's keys go
    to ``$AFD_MRV2_ADDITIONAL_CONFIG``, the user's stay in ``additional_config``; returns the latter."""
    from afd_mrv2.admission import place_own_keys
    from afd_mrv2.compat.detect import detect_runtime

    out["platform"] = detect_runtime().platform
    additional, env = place_own_keys(USER_KEYS, {"afd": AFD})
    out["placed"] = {"additional_config": additional, "env": {k: json.loads(v) for k, v in env.items()}}
    os.environ.update(env)  # as the engine's processes inherit it
    return additional


def main() -> dict[str, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.plugins import load_general_plugins
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.utils import register_ascend_customop

    from afd_mrv2.config import parse_afd_config
    from afd_mrv2.mrv2.attention import remote
    from afd_mrv2.mrv2.attention.worker import _attention_role
    from afd_mrv2.mrv2.platforms.ascend.attention import install_attention_layer
    from afd_mrv2.validation import afd_section

    out: dict[str, Any] = {}
    additional = _place_own_keys(out)
    load_general_plugins()  # vllm-ascend's platform patches (its FusedMoEFactory), as a worker's start-up
    vllm_config = _vllm_config(additional)  # NPUPlatform.check_and_update_config -> init_ascend_config: passes
    with set_current_vllm_config(vllm_config):
        register_ascend_customop(vllm_config)  # NPUWorker.__init__'s order: the platform's ops first
        registered = op_registry_oot["RoutedExperts"]
        _stage(out, "install", install_attention_layer)
        _stage(out, "install_again", install_attention_layer)
        entry = op_registry_oot["RoutedExperts"]
        out["registry"] = [f"{c.__module__}.{c.__qualname__}" for c in entry.__mro__[:2]]
        # NPUPlatform.check_and_update_config -> init_ascend_config validates additional_config (extra="forbid")
        _stage(out, "vllm_config_with_afd", lambda: _vllm_config({**USER_KEYS, "afd": AFD}) and "accepted")
        # the section through the environment: vllm-ascend's check (again, as NPUWorker.__init__ runs it), then
        # what afd-mrv2's readers find in this VllmConfig (the Attention worker's, every admit's)
        _stage(out, "ascend_config", lambda: init_ascend_config(vllm_config) and "initialized")
        out["additional_config_keys"] = sorted(vllm_config.additional_config)  # vllm-ascend adds its own
        _stage(out, "afd_section", lambda: afd_section(vllm_config.additional_config))
        _stage(out, "attention_role", lambda: _attention_role(vllm_config))
        if _stage(out, "groups", lambda: _groups(vllm_config)) is None:
            return out
        # the registered class as a model builds it: admit() decides before any AFD quant method exists
        _stage(out, "production_layer", lambda: _describe(_layer(None, prefix="model.layers.9.mlp.experts")))
        peer = FakePeer(parse_afd_config(AFD))
        remote._PROCESS = peer  # attach() and the transfer's custom op find the stand-in FFN peer
        _attention_stages(out, vllm_config, registered, peer)
        _ffn_stages(out, vllm_config)
    return out


AFD = {"role": "attention", "connector": "torch_p2p"}
#: a user's additional_config key that vllm-ascend owns (AscendConfig.enable_kv_nz, its default)
USER_KEYS = {"enable_kv_nz": False}

if __name__ == "__main__":
    print("VEHICLE " + json.dumps(main(*sys.argv[1:])), flush=True)
