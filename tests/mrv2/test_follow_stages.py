"""The FFN role accepts both stage counts: an Attention side that splits some steps and not others.

On the vLLM path every Attention engine decides alone whether a step is split,
so an FFN rank cannot know a step's stage count in advance: torch_p2p's FFN side
(``follow_stages``, what :func:`serve_ffn` runs) takes each item's layer and
stage identity from the header and checks the order.  Here one Attention process
(RemoteExperts, its micro-batch hand-off driven by the test: a split step is open
while ``current`` says so) runs a 2-stage step, an unsplit step and a 2-stage step
against a real serve_ffn over gloo; every output must equal the reference.  A stage
count that changes mid-step fails loudly on the FFN side, naming the Attention rank
and both identities; a step abandoned half-way (a failed micro-batch) may be followed
by a new one.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.mrv2.attention.handoff import Handoff, SplitStep, close_step, open_step
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.procs import free_port
from tests.mrv2.test_vllm_path import LAYERS, SHAPE, _reference, afd, start_ffn


def _pair(done: dict[str, Any], current: list[int]) -> tuple[threading.Thread, RemoteExperts]:
    """A real serve_ffn thread and one Attention side whose (stage, stage count) is ``current``."""
    port = free_port()
    thread = start_ffn(done, afd("ffn", port))
    handoff = Handoff(active=lambda: current[1] > 1, current=lambda: current[0], hand_over=lambda: None)
    remote = RemoteExperts(parse_afd_config(afd("attention", port)), max_tokens=32, handoff=handoff)
    for layer in LAYERS:
        remote.add_layer(layer, SHAPE)
    return thread, remote


def _step(remote: RemoteExperts, current: list[int], stages: int, tokens: int, gen: torch.Generator) -> float:
    """One step of both MoE layers in ``stages`` stages (layer-major, stages in order); worst |diff|."""
    worst = 0.0
    step = SplitStep(stages, remote.handoff) if stages > 1 else None  # type: ignore[arg-type]
    if step is not None:
        open_step(step)
    try:
        for ordinal, layer in enumerate(LAYERS):
            for stage in range(stages):
                current[:] = [stage, stages]
                x = torch.randn(tokens, SHAPE.hidden_size, generator=gen)
                weights = torch.rand(tokens, SHAPE.top_k, generator=gen)
                ids = torch.randint(0, SHAPE.num_experts, (tokens, SHAPE.top_k), generator=gen, dtype=torch.int32)
                out = remote.exchange(layer, x, weights, ids)
                worst = max(worst, float((out - _reference(ordinal, x, weights, ids)).abs().max()))
    finally:
        if step is not None:
            close_step(step)
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


def _one_call(remote: RemoteExperts, current: list[int], layer: int, stage: int, stages: int) -> None:
    x, w = torch.randn(4, SHAPE.hidden_size), torch.rand(4, SHAPE.top_k)
    ids = torch.zeros(4, SHAPE.top_k, dtype=torch.int32)
    current[:] = [stage, stages]
    step = SplitStep(stages, remote.handoff) if stages > 1 else None  # type: ignore[arg-type]
    if step is not None:
        open_step(step)
    try:
        remote.exchange(layer, x, w, ids)
    finally:
        if step is not None:
            close_step(step)


def test_a_stage_count_that_changes_mid_step_fails_naming_both_identities(one_torch_thread: None) -> None:
    done: dict[str, Any] = {}
    current = [0, 2]
    thread, remote = _pair(done, current)
    try:
        _one_call(remote, current, LAYERS[0], 0, 2)  # layer 0, stage 0 of 2
        with pytest.raises(Exception) as info:  # then claims layer 1 unsplit where stage 1 of 2 must follow
            _one_call(remote, current, LAYERS[1], 0, 1)
    finally:
        remote.close()
    thread.join(30)
    assert "stage identity out of order" in str(info.value), info.value
    assert "sent layer=1 stage 0 of 1 (seq=1) after layer=0 stage 0 of 2" in str(info.value)
    assert "expects layer=0 stage 1" in str(info.value)


def test_a_new_step_may_follow_a_step_abandoned_half_way(one_torch_thread: None) -> None:
    """A micro-batched step whose micro-batch failed ends after a partial layer; the engine's next step
    starts at layer 0 (unsplit here), and the FFN serves it: the seq of every message is still checked."""
    done: dict[str, Any] = {}
    current = [0, 2]
    thread, remote = _pair(done, current)
    gen = torch.Generator().manual_seed(3)
    try:
        _one_call(remote, current, LAYERS[0], 0, 2)  # layer 0 stage 0 of 2, then the step was abandoned
        assert _step(remote, current, 1, 5, gen) <= 1e-5
    finally:
        remote.close()
    thread.join(30)
    assert not thread.is_alive() and "error" not in done, done
    assert dict(done["report"].items_by_stage_count) == {2: 1, 1: 2}
