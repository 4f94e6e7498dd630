"""The FFN role accepts both stage counts: an Attention side that splits some steps and not others.

On the vLLM path every Attention engine decides alone whether a step is split,
so an FFN rank cannot know a step's stage count in advance: torch_p2p's FFN side
(``follow_stages``, what :func:`serve_ffn` runs) takes each item's layer and
stage identity from the header and checks the order.  Here one Attention process
(RemoteExperts, its ``stage_of`` driven by the test) runs a 2-stage step, an
unsplit step and a 2-stage step against a real serve_ffn over gloo; every output
must equal the reference.  A stage count that changes mid-step fails loudly on
the FFN side, naming the Attention rank and both identities.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.remote import RemoteExperts
from tests.mrv2.test_vllm_path import LAYERS, SHAPE, _free_port, _reference, afd, start_ffn


def _pair(done: dict[str, Any], current: list[int]) -> tuple[threading.Thread, RemoteExperts]:
    """A real serve_ffn thread and one Attention side whose (stage, stage count) is ``current``."""
    port = _free_port()
    thread = start_ffn(done, afd("ffn", port))
    remote = RemoteExperts(
        parse_afd_config(afd("attention", port)), max_tokens=32, stage_of=lambda: (current[0], current[1])
    )
    for layer in LAYERS:
        remote.add_layer(layer, SHAPE)
    return thread, remote


def _step(remote: RemoteExperts, current: list[int], stages: int, tokens: int, gen: torch.Generator) -> float:
    """One step of both MoE layers in ``stages`` stages (layer-major, stages in order); worst |diff|."""
    worst = 0.0
    for ordinal, layer in enumerate(LAYERS):
        for stage in range(stages):
            current[:] = [stage, stages]
            x = torch.randn(tokens, SHAPE.hidden_size, generator=gen)
            weights = torch.rand(tokens, SHAPE.top_k, generator=gen)
            ids = torch.randint(0, SHAPE.num_experts, (tokens, SHAPE.top_k), generator=gen, dtype=torch.int32)
            out = remote.exchange(layer, x, weights, ids)
            worst = max(worst, float((out - _reference(ordinal, x, weights, ids)).abs().max()))
    return worst


def test_ffn_serves_split_and_unsplit_steps_of_one_engine(one_torch_thread: None) -> None:
    done: dict[str, Any] = {}
    current = [0, 1]
    thread, remote = _pair(done, current)
    gen = torch.Generator().manual_seed(0)
    try:
        diffs = [_step(remote, current, stages, tokens, gen) for stages, tokens in ((2, 5), (1, 9), (2, 3))]
    finally:
        remote.close()
    thread.join(30)
    assert not thread.is_alive() and "error" not in done, done
    assert max(diffs) <= 1e-5, diffs
    assert done["report"].items == remote.calls == 2 * (2 + 1 + 2)
    assert remote.steps == 3


def test_a_stage_count_that_changes_mid_step_fails_naming_both_identities(one_torch_thread: None) -> None:
    done: dict[str, Any] = {}
    current = [0, 2]
    thread, remote = _pair(done, current)
    x, w = torch.randn(4, SHAPE.hidden_size), torch.rand(4, SHAPE.top_k)
    ids = torch.zeros(4, SHAPE.top_k, dtype=torch.int32)
    try:
        remote.exchange(LAYERS[0], x, w, ids)  # layer 0, stage 0 of 2
        current[:] = [0, 1]  # then claims the step was unsplit: stage 0 of 1 where stage 1 of 2 must follow
        with pytest.raises(Exception) as info:
            remote.exchange(LAYERS[0], x, w, ids)
    finally:
        remote.close()
    thread.join(30)
    assert "stage identity out of order" in str(info.value), info.value
    assert "sent layer=0 stage 0 of 1 (seq=1) after layer=0 stage 0 of 2" in str(info.value)
    assert "expects layer=0 stage 1" in str(info.value)
