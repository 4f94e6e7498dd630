"""``--quant w8a8``: per-token int8 dispatch, dequantized inside the FFN compute, within a derived bound.

The bound, derived before any run from the int8 step alone (the code is
``afd_mrv2/reference/quant_check.py``; its docstring has the same derivation):

1. Per-token symmetric int8: ``scale_t = max_j |x_tj| / 127``, ``q = round(x / scale_t)``.
   Rounding to the nearest step errs by at most half a step:
   ``|dx_tj| <= eps_t = scale_t / 2 = max_j |x_tj| / 254``.
2. The router ran on the float rows (Attention side), so the FFN ranks apply the
   same experts with the same weights ``p_k >= 0`` to ``x + dx``.
3. One SwiGLU expert ``E(x) = W2 (silu(W1 x) * (W3 x))``, with ``g = W1 x``, ``u = W3 x``:
   ``|dg_i| <= ||W1_i||_1 eps_t`` and ``|du_i| <= ||W3_i||_1 eps_t`` (Hoelder);
   ``silu(g+dg)(u+du) - silu(g)u = (silu(g+dg) - silu(g))(u+du) + silu(g) du`` and
   ``silu' <= 1.0998 < 1.1`` give ``|dh_i| <= 1.1 |dg_i| (|u_i| + |du_i|) + |silu(g_i)| |du_i|``;
   then ``|dE_j| <= sum_i |W2_ji| |dh_i|``.
4. The MoE output ``S(x) + sum_k p_k E_k(x)`` moves by at most
   ``bound_S + sum_k p_k bound_Ek`` per element, plus 1e-5 for the float round-off
   of the split-and-sum (the float run's own tolerance).

It is a worst case over every sign pattern of the rounding errors, so it is
loose (the measured error uses a small fraction of it: random signs cancel);
what it guarantees is that no correct int8 path can exceed it, and a path that
drops or misapplies the scales exceeds it by orders of magnitude.  It bounds
each MoE output against the float MoE of the same input and routing, which is
what the run checks; end to end the next layers' routers may pick another expert
for a near-tied token (a jump no step size bounds), so that difference is
reported, not bounded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from afd_mrv2.hooks.p2p import ProtocolError, wire
from afd_mrv2.hooks.quant import dequantize_per_token, error_bound, quantize_per_token
from afd_mrv2.items import WorkItem
from afd_mrv2.reference.forward import attention_step, embed
from afd_mrv2.reference.owners import FfnOwner
from afd_mrv2.reference.quant_check import moe_error_bound
from afd_mrv2.reference.spec import ModelSpec
from afd_mrv2.reference.weights import build_weights
from afd_mrv2.topology import Topology
from tests.procs import afd, running

SMALL = ["--hidden", "64", "--expert-size", "128", "--layers", "3", "--batches", "1", "--warmup", "1"]


def test_per_token_int8_errs_by_at_most_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)  # rows of very different scales
    x[5] = 0.0
    q, scales = quantize_per_token(x)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (64,)
    assert int(q.abs().amax(dim=1).min()) == 0 and int(q.abs().max()) == 127
    err = (dequantize_per_token(q, scales) - x).abs()
    assert bool((err <= error_bound(x).unsqueeze(1) * (1 + 1e-6)).all())
    assert float(err.max()) > 0 and torch.equal(dequantize_per_token(q, scales)[5], x[5])


def test_the_quantized_dispatch_layout_carries_int8_rows_and_their_scales() -> None:
    fp32, w8a8 = wire.DispatchLayout(64, 2), wire.DispatchLayout(64, 2, "w8a8")
    assert (fp32.kind, w8a8.kind) == (wire.KIND_DISPATCH, wire.KIND_DISPATCH_W8A8)
    assert w8a8.nbytes(5) == 5 * 64 + 5 * 4 + 5 * 2 * 8 < fp32.nbytes(5)
    odd = wire.DispatchLayout(7, 1, "w8a8")  # 5 x 7 int8 bytes are padded so the fp32 blocks stay aligned
    buffer = torch.zeros(odd.nbytes(5), dtype=torch.uint8)
    hidden, weights, ids = odd.views(buffer, 5)
    hidden.copy_(torch.arange(35, dtype=torch.int8).view(5, 7))
    odd.scales(buffer, 5).copy_(torch.arange(5, dtype=torch.float32))
    weights.fill_(0.5)
    ids.fill_(3)
    again = odd.views(buffer, 5)
    assert again[0].dtype == torch.int8 and torch.equal(again[0], torch.arange(35, dtype=torch.int8).view(5, 7))
    assert odd.scales(buffer, 5).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert bool((again[1] == 0.5).all()) and bool((again[2] == 3).all())


def test_a_rank_without_quant_fails_on_the_header_kind() -> None:
    item = WorkItem(0, 0, 0)
    got = wire.item_header(wire.KIND_DISPATCH_W8A8, 0, 1, item, 3)
    want = wire.item_header(wire.KIND_DISPATCH, 0, 1, item, 0)
    with pytest.raises(ProtocolError, match="field 'kind' expected dispatch, got dispatch-w8a8"):
        wire.validate_header(got, want, peer_name="attention rank 0", what="dispatch", max_tokens=8)


def test_the_ffn_owner_dequantizes_in_compute_within_the_derived_bound() -> None:
    """The FFN compute gets int8 rows and their scales; its output stays within the bound of the float one."""
    spec = ModelSpec(hidden_size=64, expert_size=128, shared_size=128, num_layers=1)
    weights = build_weights(spec)
    tokens = torch.randint(0, spec.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    _, x, ids, topk_weights = attention_step(weights, spec, 0, embed(weights, tokens), [20, 28])
    owner = FfnOwner(spec, weights, Topology(1, 1, spec.num_experts), 0)
    item = WorkItem(0, 0, 0)
    reference = owner.compute(item, x, ids, topk_weights)
    q, scales = quantize_per_token(x)
    got = owner.compute(item, q, ids, topk_weights, scales)
    diff, bound = (got - reference).abs(), moe_error_bound(x, ids, topk_weights, weights.layers[0])
    assert float(diff.max()) > 1e-4, "the int8 path must change bits (else it silently ran in float)"
    assert bool((diff <= bound).all()), f"worst diff/bound {float((diff / bound).max()):.3f}"
    # without its scales the int8 rows are ~127/|x| times too large: far outside the bound
    unscaled = owner.compute(item, q.to(torch.float32), ids, topk_weights)
    assert bool(((unscaled - reference).abs() > bound).any())


def run_json(out: Path, *args: str, timeout_s: float = 180.0) -> dict:
    proc = afd("run", "--json", "--out", str(out), *SMALL, *args)
    with running(proc, out_dir=out):
        code = proc.wait(timeout_s)
    assert code == 0, f"exit {code}\n{proc.stderr[-3000:]}"
    return json.loads(proc.out[0])


def test_run_w8a8_is_checked_against_the_float_moe_within_the_derived_bound(tmp_path: Path) -> None:
    report = run_json(tmp_path / "q", "--quant", "w8a8", "--attention", "2", "--ffn", "2")
    quant = report["quant"]
    assert report["ok"] and quant["mode"] == "w8a8" and quant["elements_compared"] > 0
    assert report["tolerance"] == quant["max_bound"] and 0 <= quant["worst_ratio"] <= 1.0
    for mode in report["modes"]:  # both modes ran the int8 path: it changed bits, within the bound
        assert 1e-4 < mode["max_abs_diff"] <= quant["max_bound"], mode["mode"]
    assert report["max_abs_diff"] == quant["max_abs_diff"]
    assert quant["end_to_end_max_abs_diff"] > 1e-4
    from afd_mrv2.reference.report import render

    text = render(report, as_json=False)
    assert "w8a8: max |diff| of each MoE output vs the float MoE (same input and routing)" in text
    assert "tolerance: the int8 bound, elementwise" in text and "end to end vs the float single-process" in text
