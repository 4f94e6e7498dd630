"""The vLLM path's vLLM-free parts: config refusals, and one Attention process and one FFN
process (here: two threads) exchanging round trips over their own gloo group, exactly as
the vLLM roles do (RemoteExperts on the Attention side, serve_ffn + FfnLoop on the FFN side,
torch_p2p with its round-trip attention side in between)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import ConfigError
from afd_mrv2.mrv2.ffn_server import FfnReport, ffn_serving_config, serve_ffn
from afd_mrv2.mrv2.p2p_link import IDLE_TIMEOUT_S
from afd_mrv2.mrv2.remote import MoeShape, RemoteExperts, check_vllm_path

SHAPE = MoeShape(hidden_size=16, top_k=2, num_experts=4)
LAYERS = (3, 7)  # model layer indices of the MoE layers (not contiguous: ordinals 0 and 1)


def afd(role: str, port: int = 29500, **extra: Any) -> dict[str, Any]:
    return {"connector": "torch_p2p", "role": role, "port": port, "compute_gate_on_attention": True, **extra}


def test_gate_on_the_ffn_side_is_refused_on_the_vllm_path() -> None:
    with pytest.raises(ConfigError) as info:
        check_vllm_path(parse_afd_config({**afd("attention"), "compute_gate_on_attention": False}))
    text = str(info.value)
    assert text.startswith("afd.compute_gate_on_attention: expected true on the vLLM path") and "\n" not in text
    with pytest.raises(ConfigError, match=r"^afd\.num_attention_ranks: expected 1"):
        RemoteExperts(parse_afd_config({**afd("attention"), "num_attention_ranks": 2}), max_tokens=8)


def test_ffn_serving_config_waits_for_idle_attention_engines() -> None:
    assert dict(ffn_serving_config(afd("ffn")).extra) == {"recv_timeout_s": IDLE_TIMEOUT_S}
    kept = ffn_serving_config(afd("ffn", connector_extra_config={"recv_timeout_s": 5}))
    assert kept.extra == {"recv_timeout_s": 5}
    with pytest.raises(ConfigError, match=r"^afd\.role: expected ffn"):
        ffn_serving_config(afd("attention"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _expert_weights(layer: int) -> torch.Tensor:
    return torch.randn(
        SHAPE.num_experts, SHAPE.hidden_size, SHAPE.hidden_size, generator=torch.Generator().manual_seed(layer)
    )


def _reference(layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = _expert_weights(layer)
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        out += weights[:, k : k + 1] * torch.einsum("th,thg->tg", x, w[ids[:, k].long()])
    return out


def test_round_trips_between_attention_and_ffn_roles(one_torch_thread: None) -> None:
    port = _free_port()
    experts = [lambda x, w, ids, layer=layer: _reference(layer, x, w, ids) for layer in range(len(LAYERS))]
    done: dict[str, Any] = {}

    def ffn() -> None:
        try:
            done["report"] = serve_ffn(
                ffn_serving_config(afd("ffn", port)),
                experts,
                SHAPE,
                max_tokens=32,
                dtype=torch.float32,
                device=torch.device("cpu"),
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread
            done["error"] = exc

    thread = threading.Thread(target=ffn, daemon=True)
    thread.start()
    remote = RemoteExperts(parse_afd_config(afd("attention", port)), max_tokens=32)
    for layer in LAYERS:
        remote.add_layer(layer, SHAPE)
    gen = torch.Generator().manual_seed(0)
    try:
        for tokens in (5, 32, 1):  # three forwards of both MoE layers
            for ordinal, layer in enumerate(LAYERS):
                x = torch.randn(
                    tokens, SHAPE.hidden_size, generator=gen, dtype=torch.float64
                )  # cast to the wire format
                weights = torch.rand(tokens, SHAPE.top_k, generator=gen)
                ids = torch.randint(0, SHAPE.num_experts, (tokens, SHAPE.top_k), generator=gen, dtype=torch.int32)
                out = remote.exchange(layer, x, weights, ids)
                assert out.dtype == torch.float64 and out.shape == x.shape
                expected = _reference(ordinal, x.float(), weights, ids).double()
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    finally:
        remote.close()
    thread.join(30)
    assert not thread.is_alive() and "error" not in done, done
    report: FfnReport = done["report"]
    assert report.items == remote.calls == 6
    assert dict(report.tokens_per_item) == {5: 2, 32: 2, 1: 2} == dict(remote.tokens)
    assert "the attention rank closed its AFD session" in report.end
