"""The vLLM path's vLLM-free parts: config refusals, and one Attention process and one FFN
process (here: two threads) exchanging round trips over their own gloo group, exactly as
the vLLM roles do (RemoteExperts on the Attention side, serve_ffn + FfnLoop on the FFN side,
torch_p2p with its round-trip attention side in between)."""

from __future__ import annotations

import datetime
import threading
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from afd_mrv2.config import MultistreamConfig, parse_afd_config
from afd_mrv2.devices.base import Span
from afd_mrv2.errors import ConfigError
from afd_mrv2.items import WorkItem
from afd_mrv2.mrv2.attention.remote import RemoteExperts, attention_backend, check_vllm_path
from afd_mrv2.mrv2.ffn.report import FfnReport, overlap_figures
from afd_mrv2.mrv2.ffn.server import ffn_serving_config, local_routing, serve_ffn
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.mrv2.transport.store import IDLE_TIMEOUT_S, PREFIX
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.procs import free_port

SHAPE = MoeShape(hidden_size=16, top_k=2, num_experts=4)
LAYERS = (3, 7)  # model layer indices of the MoE layers (not contiguous: ordinals 0 and 1)


def afd(role: str, port: int = 29500, *, transport: str = "gloo", **extra: Any) -> dict[str, Any]:
    """The afd section of ``role`` on the store at ``port``; its pairs run on ``transport`` (``afd.transport``)."""
    return {
        "connector": "torch_p2p",
        "role": role,
        "port": port,
        "compute_gate_on_attention": True,
        "transport": transport,
        **extra,
    }


def pair_transport(port: int, pair: str) -> str | None:
    """What the pair named ``pair`` (``a0.1-f1.2``) was joined on, read from the store at ``port`` while it
    runs: None when its FFN side never said hello; ``zmq`` or ``tcp`` when that side published its endpoint
    under that name (a zmq or tcp FFN side does so before its hello, a gloo one never), else ``gloo``."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    if not store.check([f"{PREFIX}/{pair}/hello/ffn"]):
        return None
    published = [kind for kind in ("zmq", "tcp") if store.check([f"{PREFIX}/{pair}/{kind}/endpoint"])]
    return published[0] if published else "gloo"


def test_gate_on_the_ffn_side_is_refused_on_the_vllm_path() -> None:
    with pytest.raises(ConfigError) as info:
        check_vllm_path(parse_afd_config({**afd("attention"), "compute_gate_on_attention": False}))
    text = str(info.value)
    assert text.startswith("afd.compute_gate_on_attention: expected true on the vLLM path") and "\n" not in text


def test_ffn_serving_config_waits_for_idle_attention_engines() -> None:
    assert dict(ffn_serving_config(afd("ffn")).extra) == {"recv_timeout_s": IDLE_TIMEOUT_S}
    kept = ffn_serving_config(afd("ffn", connector_extra_config={"recv_timeout_s": 5}))
    assert kept.extra == {"recv_timeout_s": 5}
    with pytest.raises(ConfigError, match=r"^afd\.role: expected ffn"):
        ffn_serving_config(afd("attention"))


def _expert_weights(layer: int) -> torch.Tensor:
    return torch.randn(
        SHAPE.num_experts, SHAPE.hidden_size, SHAPE.hidden_size, generator=torch.Generator().manual_seed(layer)
    )


def start_ffn(
    done: dict[str, Any],
    raw: dict[str, Any],
    experts: list[Any] | None = None,
    *,
    key: object = "",
    shape: MoeShape = SHAPE,
    max_tokens: int = 32,
    **kwargs: Any,
) -> threading.Thread:
    """``serve_ffn`` of the afd section ``raw`` on a daemon thread (the FFN process of these tests).

    Its report lands in ``done[f"report{key}"]``, an exception in ``done[f"error{key}"]``;
    ``experts`` defaults to the full reference experts of every layer.
    """
    if experts is None:
        experts = [lambda x, w, ids, layer=layer: _reference(layer, x, w, ids) for layer in range(len(LAYERS))]

    def ffn() -> None:
        try:
            done[f"report{key}"] = serve_ffn(
                ffn_serving_config(raw),
                experts,
                shape,
                max_tokens=max_tokens,
                dtype=torch.float32,
                device=torch.device("cpu"),
                **kwargs,
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread
            done[f"error{key}"] = exc

    thread = threading.Thread(target=ffn, daemon=True)
    thread.start()
    return thread


def _reference(layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = _expert_weights(layer)
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        out += weights[:, k : k + 1] * torch.einsum("th,thg->tg", x, w[ids[:, k].long()])
    return out


def test_round_trips_between_attention_and_ffn_roles(
    one_torch_thread: None, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AFD_MRV2_LAYOUT_LOG", "1")
    port = free_port()
    done: dict[str, Any] = {}
    thread = start_ffn(done, afd("ffn", port))
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
    # the layout log: one line per engine step (the first MoE layer), its one stage, the engine's real tokens
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("afd-mrv2 layout: ")]
    assert [line.split(" stage ")[0] for line in lines] == [
        f"afd-mrv2 layout: attention rank 0 step {s}" for s in range(3)
    ]
    assert all(
        "stage 1/1 unsplit (no async-MoE stages on the vLLM MoE seam; this engine decides alone)" in line
        for line in lines
    )
    assert [line.split(": real ")[1].split(" ")[0] for line in lines] == ["5", "32", "1"]


def _block_experts(layer: int, block: range) -> Any:
    """An expert callable holding only ``block`` of layer ``layer``'s experts (ids already block-local)."""
    weights = _expert_weights(layer)[block.start : block.stop]

    def run(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert int(ids.min()) >= 0 and int(ids.max()) < len(block), "ids must be block-local"
        out = torch.zeros_like(x)
        for k in range(ids.shape[1]):
            out += w[:, k : k + 1] * torch.einsum("th,thg->tg", x, weights[ids[:, k].long()])
        return out

    return run


def test_local_routing_weighs_other_blocks_zero_and_shifts_ids_into_the_block() -> None:
    """Pairs of other blocks weigh 0 and point at their row's first pair computed here (no other expert's
    weights are loaded for them); ids are shifted onto the held experts' positions."""
    ids = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25], [0.75, 1.0]])
    got_ids, got_w = local_routing(ids, weights, range(2, 4), 4, shift=True)
    assert got_ids.tolist() == [[1, 1], [0, 0]] and got_w.tolist() == [[0.0, 0.25], [0.75, 0.0]]
    assert got_ids.dtype == ids.dtype
    same_ids, masked = local_routing(ids, weights, range(2, 4), 4, shift=False)
    assert same_ids.tolist() == [[3, 3], [2, 2]] and masked.tolist() == got_w.tolist()
    for shift in (False, True):  # every expert held, every pair computed: as given, shifted or not
        every_id, every_w = local_routing(ids, weights, range(0, 4), 4, shift=shift)
        assert every_id is ids and every_w is weights
    # replicas: every expert held (R = F), but the Attention side sent the pair routed elsewhere with weight 0
    routed = torch.tensor([[0.5, 0.0], [0.0, 1.0]])
    got_ids, got_w = local_routing(ids, routed, range(0, 4), 4, shift=True)
    assert got_ids.tolist() == [[0, 0], [1, 1]] and got_w.tolist() == [[0.5, 0.0], [0.0, 1.0]]
    # a held set that is not one block (F=3, R=2: FFN rank 0 keeps blocks 0 and 2)
    got_ids, got_w = local_routing(torch.tensor([[5, 2]]), torch.tensor([[0.5, 0.5]]), (0, 1, 4, 5), 6, shift=True)
    assert got_ids.tolist() == [[3, 3]] and got_w.tolist() == [[0.5, 0.0]]


def checked_forward(remote: RemoteExperts, gen: torch.Generator, tokens: int) -> None:
    """One forward of ``tokens`` through every MoE layer, each output checked against the reference."""
    for ordinal, layer in enumerate(LAYERS):
        x = torch.randn(tokens, SHAPE.hidden_size, generator=gen)
        weights = torch.rand(tokens, SHAPE.top_k, generator=gen)
        ids = torch.randint(0, SHAPE.num_experts, (tokens, SHAPE.top_k), generator=gen, dtype=torch.int32)
        out = remote.exchange(layer, x, weights, ids)
        torch.testing.assert_close(out, _reference(ordinal, x, weights, ids), rtol=1e-5, atol=1e-5)


def _engine(
    a: int, remote: RemoteExperts, forwards: tuple[int, ...], rank1_may_go_on: threading.Event, done: dict[str, Any]
) -> None:
    """Attention rank ``a``'s checked ``forwards``; rank 1 idles after its first one until rank 0 ran all of its
    own.  An exception lands in ``done[f"attention-error{a}"]``."""
    gen = torch.Generator().manual_seed(10 + a)
    try:
        for n, tokens in enumerate(forwards):
            if a == 1 and n == 1:  # idle while rank 0 runs all its forwards
                assert rank1_may_go_on.wait(60), "attention rank 0 never finished"
            checked_forward(remote, gen, tokens)
        if a == 0:
            rank1_may_go_on.set()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread
        done[f"attention-error{a}"] = exc
        rank1_may_go_on.set()


@pytest.mark.parametrize("multistream", [None, {"enabled": True, "depth": 2}], ids=["serialized", "depth-2"])
def test_2a2f_engines_on_their_own_clocks_idle_attention_rank_stalls_nobody(
    one_torch_thread: None, multistream: dict[str, Any] | None
) -> None:
    """Two Attention processes, two FFN processes (threads here), experts sharded 2 + 2 and held
    block-local: attention rank 0 runs forwards while rank 1 sits idle between two bursts of
    its own (a lockstep FFN would hang rank 0's second item); every output equals the
    unsharded reference, and each FFN rank served exactly (MoE layers x forwards) items of
    each Attention rank."""
    port = free_port()
    topology: dict[str, Any] = {"num_attention_ranks": 2, "num_ffn_ranks": 2}
    if multistream is not None:
        topology["multistream"] = multistream
    done: dict[str, Any] = {}

    remotes = [
        RemoteExperts(parse_afd_config({**afd("attention", port), **topology, "rank": a}), max_tokens=32)
        for a in range(2)
    ]
    for remote in remotes:
        for layer in LAYERS:
            remote.add_layer(layer, SHAPE)
    forwards = {0: (5, 32, 1, 7, 3), 1: (4, 9)}
    rank1_may_go_on = threading.Event()

    threads = [
        start_ffn(
            done,
            {**afd("ffn", port), **topology, "rank": f},
            [_block_experts(layer, range(2 * f, 2 * f + 2)) for layer in range(len(LAYERS))],
            key=f,
            index=f,
            local_experts_only=True,
        )
        for f in range(2)
    ]
    threads += [
        threading.Thread(target=_engine, args=(a, remotes[a], forwards[a], rank1_may_go_on, done), daemon=True)
        for a in range(2)
    ]
    for thread in threads[2:]:
        thread.start()
    for thread in threads[2:]:
        thread.join(120)
    assert not any(t.is_alive() for t in threads[2:]) and not any("error" in k for k in done), done
    for remote in remotes:
        remote.close()
    for thread in threads[:2]:
        thread.join(60)
    assert not any(t.is_alive() for t in threads[:2]) and not any("error" in k for k in done), done
    calls = [remote.calls for remote in remotes]
    assert calls == [len(LAYERS) * len(forwards[a]) for a in range(2)]
    for f in range(2):
        report: FfnReport = done[f"report{f}"]
        assert dict(report.items_per_attention) == {0: calls[0], 1: calls[1]}, report.as_dict()
        assert report.end and set(report.ends) == {0, 1}
        assert report.executors == {a: {"pipelined": multistream is not None, "buffers": [2, 2]} for a in range(2)}


def test_overlap_figures_from_two_loops_traces_ignore_spans_that_never_ran() -> None:
    """Loop 0 computes 10..20 ms while loop 1 sends 15..25 ms and receives 0..10 ms; a span
    opened for the item the session ended on never started (start 0) and must not count."""
    ms = 1_000_000

    def span(name: str, start: int, end: int, seq: int) -> Span:
        return Span(name, name, 0, WorkItem(0, 0, seq), (0, 0), start * ms, end * ms)

    loop0, loop1 = Trace(role="ffn"), Trace(role="ffn")
    for sp in (span("recv", 1000, 1010, 0), span("compute", 1010, 1020, 0), span("send", 1020, 1021, 0)):
        loop0.add(sp)
    for sp in (span("recv", 1000, 1010, 0), span("send", 1015, 1025, 0)):
        loop1.add(sp)
    loop1.add(Span("recv", "recv", 0, WorkItem(0, 0, 1), (0, 0)))  # never ran
    got = overlap_figures([loop0, loop1])
    assert got["items"] == 1 and got["active_ms"] == 25.0 and got["compute_ms"] == 10.0
    assert got["send_hidden_fraction"] == round(5 / 11, 4)  # 5 of the 11 send ms under compute
    assert got["hidden_comm_fraction"] == round(5 / 31, 4)  # recv 20 ms + send 11 ms
    assert got["busy_ms"] == {"compute": 10.0, "recv": 20.0, "send": 11.0}
    assert overlap_figures([]) == {"items": 0}


def test_the_serialized_attention_side_runs_its_phases_on_the_models_thread_on_a_cpu() -> None:
    serialized = MultistreamConfig()
    assert attention_backend(serialized) == ("auto" if torch.accelerator.is_available() else "inline")
    assert attention_backend(replace(serialized, backend="host")) == "host"  # said explicitly: kept
    pipelined = MultistreamConfig(enabled=True, roles=("attention", "ffn"))
    assert attention_backend(pipelined) == "auto"  # stream threads overlap the phases there


def test_vllms_attention_process_opens_its_link_off_the_model_thread(one_torch_thread: None) -> None:
    """``open_early`` (what :func:`attach` sets in vLLM's process): the pairs with the FFN ranks are joined
    on a thread of its own once the first MoE layer is registered, before any transfer; the first transfer
    then finds the link open."""
    port = free_port()
    done: dict[str, Any] = {}
    thread = start_ffn(done, afd("ffn", port))
    remote = RemoteExperts(parse_afd_config(afd("attention", port)), max_tokens=32, open_early=True)
    caller = threading.current_thread()
    try:
        for layer in LAYERS:
            remote.add_layer(layer, SHAPE)
        opener = next(t for t in threading.enumerate() if t.name == "afd-open-attention0")
        assert opener is not caller
        opener.join(30)
        assert not opener.is_alive() and remote.calls == 0  # joined, and no transfer asked for it
        gen = torch.Generator().manual_seed(1)
        x, w = torch.randn(4, SHAPE.hidden_size, generator=gen), torch.rand(4, SHAPE.top_k, generator=gen)
        ids = torch.randint(0, SHAPE.num_experts, (4, SHAPE.top_k), generator=gen, dtype=torch.int32)
        torch.testing.assert_close(remote.exchange(LAYERS[0], x, w, ids), _reference(0, x, w, ids))
    finally:
        remote.close()
    thread.join(30)
    assert "error" not in done, done
