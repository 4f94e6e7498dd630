"""The vLLM path with torch_p2p's ``quant: w8a8``: RemoteExperts dispatches int8 rows and their scales,
serve_ffn's compute dequantizes them (no vLLM needed: the experts are plain functions).

Bound: each element of an int8 row errs by at most half a step, ``eps_t = max|x_t| / 254``
(:mod:`afd_mrv2.hooks.quant`); these experts are linear, ``y = sum_k w_k x W_k``, so
``|dy_tg| <= eps_t * sum_k |w_tk| * sum_h |W_k[h, g]|`` (plus 1e-5 of float round-off).
"""

from __future__ import annotations

from typing import Any

import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.procs import free_port
from tests.mrv2.test_vllm_path import LAYERS, SHAPE, _expert_weights, _reference, afd, start_ffn

QUANT = {"connector_extra_config": {"quant": "w8a8"}}


def _bound(ordinal: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    eps = x.abs().amax(dim=1, keepdim=True) / 254
    column_l1 = _expert_weights(ordinal).abs().sum(dim=1)  # [E, H_out]: sum_h |W_e[h, g]|
    per_k = weights.abs().unsqueeze(2) * column_l1[ids.long()]  # [T, k, H]
    return eps * per_k.sum(dim=1) + 1e-5


def test_quantized_round_trips_on_the_vllm_path_stay_within_the_int8_bound(one_torch_thread: None) -> None:
    port = free_port()
    done: dict[str, Any] = {}
    thread = start_ffn(done, afd("ffn", port, **QUANT))
    remote = RemoteExperts(parse_afd_config(afd("attention", port, **QUANT)), max_tokens=32)
    for layer in LAYERS:
        remote.add_layer(layer, SHAPE)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    try:
        for tokens in (5, 32):
            for ordinal, layer in enumerate(LAYERS):
                x = torch.randn(tokens, SHAPE.hidden_size, generator=gen)
                weights = torch.rand(tokens, SHAPE.top_k, generator=gen)
                ids = torch.randint(0, SHAPE.num_experts, (tokens, SHAPE.top_k), generator=gen, dtype=torch.int32)
                out = remote.exchange(layer, x, weights, ids)
                diff = (out - _reference(ordinal, x, weights, ids)).abs()
                assert bool((diff <= _bound(ordinal, x, weights, ids)).all())
                worst = max(worst, float(diff.max()))
    finally:
        remote.close()
    thread.join(30)
    assert not thread.is_alive() and "error" not in done, done
    assert worst > 1e-4, "the int8 path must change bits (else it silently ran in float)"
