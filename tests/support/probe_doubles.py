"""The stream probe run against the CAM doubles: same evidence as ``afd-mrv2 probe npu``.

Each operator is classified by :func:`afd_mrv2.probe.streams.classify_late` on a
host-backend probe stream, in both directions where one operator serves both
(``a2e`` sends on attention, receives on FFN), on a dedicated ``probe`` group so
the run's channels stay untouched.  An operator is FOREIGN if any direction is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd_mrv2.devices import HostBackend
from afd_mrv2.hooks.cam.evidence import Evidence, OpEvidence, StreamBehaviour
from afd_mrv2.probe.streams import ProbeCheck, classify_late
from tests.support.camasync_doubles import CamAsyncDoubles
from tests.support.camp2p_doubles import CamP2PDoubles
from tests.support.doubles_base import CamDoubles

_H, _K, _E, _T = 4, 2, 4, 3


def _evidence(
    doubles: CamDoubles, ops: tuple[str, ...], ranks: tuple[int, ...], runs: tuple[Callable[[], ProbeCheck], ...]
) -> Evidence:
    """Classify each step (operator ``ops[i]`` called by ``runs[i]`` on world rank ``ranks[i]``), in order.

    After each step the rank's own stream is drained, so the next step starts from settled state.
    """
    backend = HostBackend()
    found: dict[str, list[tuple[StreamBehaviour, str]]] = {}
    try:
        for op, rank, run in zip(ops, ranks, runs, strict=True):
            found.setdefault(op, []).append(classify_late(backend, run))
            doubles.worker(rank).drain()
    finally:
        backend.close(0.0)
    ops = {}
    for op, results in found.items():
        foreign = [d for b, d in results if b is StreamBehaviour.FOREIGN]
        stream = StreamBehaviour.FOREIGN if foreign else StreamBehaviour.CURRENT
        qualname = f"{doubles.NAMESPACE}.{op}"
        ops[qualname] = OpEvidence(qualname, True, stream, None, None, (foreign or [results[0][1]])[0])
    return Evidence({"operators": f"test doubles {type(doubles).__name__}"}, ops)


def probe_camp2p(d: CamP2PDoubles) -> Evidence:
    """Classify a2e/e2a of ``d`` on group ``probe`` (FFN world rank 0, attention world rank 1)."""
    x, y, box = torch.randn(_T, _H), torch.randn(_T, _H), {}
    sizes = dict(hidden_size=_H, topk=_K, expert_rank_size=1, attention_rank_size=1, group_ep="probe", aiv_num=8)

    def send_a2e() -> ProbeCheck:
        d.a2e(x, None, None, batch_size=_T, rank=1, compute_gate=0, **sizes)
        return lambda: d.fabric.peek(channel=("a2e", "probe"), dst=0)

    def recv_a2e() -> ProbeCheck:
        box["a2e"] = out = d.a2e(x[:0], None, None, batch_size=_T, rank=0, compute_gate=0, **sizes)
        return lambda: bool(out[4].all()) and torch.equal(out[0], x)

    def send_e2a() -> ProbeCheck:
        d.e2a(y, box["a2e"][3], batch_size=_T, rank=0, **sizes)
        return lambda: d.fabric.peek(channel=("e2a", "probe"), dst=1)

    def recv_e2a() -> ProbeCheck:
        out = d.e2a(x, torch.zeros(1, dtype=torch.int32), batch_size=_T, rank=1, **sizes)
        return lambda: torch.equal(out, y)

    return _evidence(d, ("a2e", "a2e", "e2a", "e2a"), (1, 0, 0, 1), (send_a2e, recv_a2e, send_e2a, recv_e2a))


def probe_camasync(d: CamAsyncDoubles) -> Evidence:
    """Classify the four async operators of ``d`` on group ``probe`` (attention world rank 0, FFN 1)."""
    x = torch.randn(_T, _H)
    ids = torch.tensor([[0, 1]] * _T)
    weights = torch.full((_T, _K), 0.5)
    routed_out, box = torch.randn(_T * _K, _H), {}
    common = dict(
        comm_id=0,
        hidden_size=_H,
        topk=_K,
        ffn_size=1,
        attn_size=1,
        expert_per_rank=_E,
        world_size=2,
        group_name="probe",
    )

    def dispatch_send() -> ProbeCheck:
        d.async_dispatch_send(
            x, ids, None, max_seq_len=8, batch_size=_T, rank=0, layer_idx=0, tp_size=1, dynamic_quant=0, **common
        )
        return lambda: d.fabric.peek(channel=("dispatch", "probe", 0), dst=1)

    def dispatch_recv() -> ProbeCheck:
        box["recv"] = out = d.async_dispatch_recv(
            x[:1], None, batch_size=8, rank=1, tp_size=1, dynamic_quant=0, **common
        )
        # expert 0 gets every token's k=0 row, expert 1 every k=1 row, in token order
        expected = torch.cat([x, x])
        return lambda: int(out[4][1]) == 0 and torch.equal(out[0][: _T * _K], expected)

    def combine_send() -> ProbeCheck:
        d.async_combine_send(routed_out, x, None, box["recv"][4], batch_size=8, rank=1, tp_size=1, **common)
        return lambda: d.fabric.peek(channel=("combine", "probe", 0), dst=0)

    def combine_recv() -> ProbeCheck:
        out = d.async_combine_recv(x[:1], ids, weights, None, batch_size=_T, rank=0, **common)
        expected = 0.5 * routed_out[:_T] + 0.5 * routed_out[_T:] + x
        return lambda: torch.allclose(out, expected)

    return _evidence(d, d.OPS, (0, 1, 1, 0), (dispatch_send, dispatch_recv, combine_send, combine_recv))
