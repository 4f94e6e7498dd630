"""One side of a 2-process torch_p2p fault scenario (run by tests/test_torch_p2p_faults.py).

    python tests/hooks/p2p/p2p_peer.py SCENARIO RANK PORT

Topology 1A1F: global rank 0 is the attention rank, global rank 1 the FFN rank.
One of them runs the real connector in an executor; the other is a rogue peer
speaking raw gloo.  The real side prints one JSON line describing how it ended
and exits 3 when it failed (the expected outcome), 0 when it did not.

Scenarios:
    bad-dispatch-FIELD  a rogue attention rank sends a dispatch header with FIELD wrong
    bad-combine-seq     a rogue FFN rank answers a dispatch with a combine header of the wrong seq
    silent-attention    the attention rank connects and never sends (FFN recv_timeout_s = 1)
    dead-attention      the attention rank exits right after start-up
    cancel              like silent-attention, but the FFN executor is closed after 0.5 s
    stages-2-vs-1       both sides real: the attention rank splits every step into 2 stages,
                        the FFN rank runs it unsplit (1 stage)
    stages-swapped      both sides real, 2 stages each, but the attention rank issues each
                        layer's stages in the other order (stage 1 first)
    concurrent          no executor: on both ranks a sender thread and a receiver thread push
                        messages through one PeerLink at the same time (the multistream
                        pattern: recv stream and send stream of one process), contents checked
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.hooks.p2p import P2pShape, PeerLink, wire
from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.plugins import load_plugins, role_context
from afd_mrv2.topology import Topology

SHAPE = P2pShape(hidden_size=8, top_k=1, num_experts=2, num_layers=2, max_tokens=4)
TOPOLOGY = Topology(1, 1, 2)
TOKENS = 3


def attention_compute(item: WorkItem, combined: torch.Tensor | None) -> tuple | None:
    if item.layer_idx == SHAPE.num_layers:
        return None
    x = torch.full((TOKENS, SHAPE.hidden_size), float(item.layer_idx + 1))
    return x, torch.zeros(TOKENS, 1, dtype=torch.int64), torch.ones(TOKENS, 1)


def ffn_compute(item: WorkItem, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return hidden * 2


def stage_items(scenario: str, role: str, layers: int) -> list[WorkItem]:
    """The work items of ``role``: one stage per layer, or the stage scenarios' two."""
    if not scenario.startswith("stages-") or (scenario == "stages-2-vs-1" and role == "ffn"):
        return [WorkItem(layer, 0, layer) for layer in range(layers)]
    swapped = scenario == "stages-swapped" and role == "attention"
    order = (1, 0) if swapped else (0, 1)
    return [WorkItem(layer, s, 2 * layer + i, num_stages=2) for layer in range(layers) for i, s in enumerate(order)]


def real_side(
    link: PeerLink, role: str, *, recv_timeout_s: float, cancel_after_s: float | None = None, scenario: str = ""
) -> int:
    config = parse_afd_config(
        {
            "connector": "torch_p2p",
            "role": role,
            "connector_extra_config": {"recv_timeout_s": recv_timeout_s},
            "multistream": {"enabled": True, "depth": 2, "roles": ["attention", "ffn"], "backend": "host"},
        }
    )
    plugins = load_plugins(role_context(config, p2p_link=link, model=SHAPE))
    compute = attention_compute if role == "attention" else ffn_compute
    executor = Executor(plugins, make_backend("host"), config.multistream, compute=compute, role=role)
    layers = SHAPE.num_layers + (1 if role == "attention" else 0)
    items = stage_items(scenario, role, layers)
    start = time.monotonic()
    if cancel_after_s is not None:
        executor.submit(items[0])
        time.sleep(cancel_after_s)
        closing = time.monotonic()
        report = executor.close(0.5)
        outcome = {
            "close_s": time.monotonic() - closing,
            "abandoned": [str(i) for i in report.abandoned],
            "abandoned_streams": report.abandoned_streams,
        }
        print(json.dumps(outcome), flush=True)
        link.abort("cancelled by the test", timeout_s=0.2)
        return 3
    try:
        executor.run(items)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        cause = exc.__cause__
        outcome = {
            "elapsed_s": time.monotonic() - start,
            "error": str(exc),
            "error_type": type(exc).__name__,
            "cause_type": type(cause).__name__,
            "field": getattr(cause, "field", None),
            "peer": getattr(cause, "peer", None),
        }
        print(json.dumps(outcome), flush=True)
        link.abort(str(exc), timeout_s=0.5)
        return 3
    executor.close()
    print(json.dumps({"elapsed_s": time.monotonic() - start, "error": None}), flush=True)
    return 0


def rogue_attention(scenario: str) -> None:
    pg = dist.group.WORLD
    if scenario == "dead-attention":
        os._exit(0)
    if scenario.startswith("bad-dispatch-"):
        field = scenario.removeprefix("bad-dispatch-")
        good = wire.Header(kind=wire.KIND_DISPATCH, src=0, dst=1, layer=0, stage=0, seq=0, tokens=TOKENS)
        wrong = {"magic": 0xBAD, "layer": 7, "tokens": SHAPE.max_tokens + 1, "dst": 0, "kind": wire.KIND_COMBINE}
        words = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
        dataclasses.replace(good, **{field: wrong[field]}).write(words)
        pg.send([words], 1, wire.TAG_DISPATCH_HEADER).wait()
    stay_until_real_side_aborts(real=1)


def rogue_ffn() -> None:
    pg = dist.group.WORLD
    words = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64)
    pg.recv([words], 0, wire.TAG_DISPATCH_HEADER).wait()
    header = wire.Header.read(words)
    layout = wire.DispatchLayout(SHAPE.hidden_size, SHAPE.top_k)
    pg.recv([torch.empty(layout.nbytes(header.tokens), dtype=torch.uint8)], 0, wire.TAG_DISPATCH_PAYLOAD).wait()
    reply = torch.zeros(wire.combine_nbytes(SHAPE.hidden_size, header.tokens), dtype=torch.uint8)
    bad = dataclasses.replace(header, kind=wire.KIND_COMBINE, src=1, dst=0, seq=header.seq + 99)
    bad.write(wire.header_view(reply))
    pg.send([reply], 0, wire.TAG_COMBINE).wait()
    stay_until_real_side_aborts(real=0)


def stay_until_real_side_aborts(real: int) -> None:
    """Stay connected (and silent) until the real side announces its failure, then leave."""
    notice = torch.empty(wire.CONTROL_BYTES, dtype=torch.uint8)
    with contextlib.suppress(RuntimeError):
        dist.group.WORLD.recv([notice], real, wire.TAG_CONTROL).wait()
    os._exit(0)


def concurrent(link: PeerLink, rank: int, messages: int = 300) -> int:
    """Both directions at once, from two threads, on distinct tags; every message checked in order."""
    peer = 1 - rank
    send_tag, recv_tag = (
        (wire.TAG_DISPATCH_PAYLOAD, wire.TAG_COMBINE) if rank == 0 else (wire.TAG_COMBINE, wire.TAG_DISPATCH_PAYLOAD)
    )
    errors: list[str] = []

    def sender() -> None:
        for i in range(messages):
            p = link.isend(torch.full((2048,), float(i + 1000 * rank)), peer, send_tag, "message")
            link.wait([p], timeout_s=20, work=None, action="sending", option="test")

    def receiver() -> None:
        buffer = torch.empty(2048)
        for i in range(messages):
            p = link.irecv(buffer, peer, recv_tag, "message")
            link.wait([p], timeout_s=20, work=None, action="receiving", option="test")
            if not bool((buffer == float(i + 1000 * peer)).all()):
                errors.append(f"message {i}: got {float(buffer[0])}")

    start = time.monotonic()
    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ok = not errors and not any(t.is_alive() for t in threads)
    print(json.dumps({"ok": ok, "errors": errors[:3], "elapsed_s": time.monotonic() - start}), flush=True)
    link.close(timeout_s=10)
    return 0 if ok else 1


def main() -> int:
    scenario, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    link = PeerLink(TOPOLOGY, rank)
    dist.barrier()
    if scenario == "concurrent":
        sys.stdout.flush()
        os._exit(concurrent(link, rank))
    rogue_rank = 1 if scenario == "bad-combine-seq" else 0
    if rank == rogue_rank and not scenario.startswith("stages-"):
        rogue_ffn() if rank == 1 else rogue_attention(scenario)
    role = "attention" if rank == 0 else "ffn"
    timeout = 1.0 if scenario in ("silent-attention",) else 30.0
    cancel = 0.5 if scenario == "cancel" else None
    code = real_side(link, role, recv_timeout_s=timeout, cancel_after_s=cancel, scenario=scenario)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
