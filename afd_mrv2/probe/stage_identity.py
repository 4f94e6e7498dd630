"""Stage identity of the real CAM operators, checked on two NPUs by ``afd-mrv2 probe npu``.

:func:`camasync_stages`, :func:`camasync_stage_rows`, :func:`camp2p_stage_row`.

See docs/internals/cam-connectors.md, "afd_mrv2.probe.stage_identity".
"""

from __future__ import annotations

from typing import Any

import torch

from afd_mrv2.hooks.cam.evidence import FAIL, PASS, SKIPPED, Check

H, K, T = 128, 2, 16
#: tokens each stage dispatches in the camasync stage-identity check: distinguishable in the CAM header
STAGE_TOKENS = (T, T // 2)
#: model layers whose header layer field the check sends as ``2 * layer + stage`` (61: DeepSeek-V3's last)
STAGE_LAYERS = (0, 9, 26, 61)
STAGE_CHECKS = {
    "camp2p": ("stage-identity:camp2p",),
    "camasync": (
        "stage-identity:camasync:dispatch-order",
        "stage-identity:camasync:combine-order",
        "stage-identity:camasync:layer-field",
    ),
}
COSINE = 0.9


def camasync_stages(me: Any, ops: dict[str, Any]) -> dict[str, Any]:
    """Attention = rank 0, FFN = rank 1: per round, stage 0 then stage 1 of one layer, as the executor issues them.

    Returns what this rank measured; :func:`camasync_stage_rows` judges both ranks' measurements.
    """
    experts, seq = 8, 256
    comm_args = torch.empty((1,), dtype=torch.float16, device=me.device)
    place = torch.empty((1,), dtype=torch.bfloat16, device=me.device)
    common = (1, 1, experts)

    def ids(n: int) -> torch.Tensor:
        return (torch.arange(n * K).reshape(n, K) % experts).to(me.device, torch.int32)

    if me.rank == 0:
        cosines = []
        for r, layer in enumerate(STAGE_LAYERS):
            sent = []
            for stage, n in enumerate(STAGE_TOKENS):
                x, topk = me.data(100 + 2 * r + stage, rows=n), ids(n)
                field = 2 * layer + stage
                ops["async_dispatch_send"](x, topk, comm_args, 0, seq, n, H, K, *common, 0, 2, field, 1, 0, me.names[0])
                sent.append((x, topk))
            row = []
            for n, (x, topk) in zip(STAGE_TOKENS, sent, strict=True):
                weights = torch.full((n, K), 0.5, device=me.device)
                out = ops["async_combine_recv"](place, topk, weights, comm_args, 0, n, H, K, *common, 0, 2, me.names[0])
                row.append(torch.nn.functional.cosine_similarity(out.float().flatten(), x.float().flatten(), dim=0))
            me.npu.synchronize()
            cosines.append([float(c) for c in row])
        return {"cosine": cosines}
    headers = []
    for _ in STAGE_LAYERS:
        got = [
            ops["async_dispatch_recv"](place, comm_args, 0, seq, H, K, *common, 1, 2, 1, 0, me.names[0])
            for _ in STAGE_TOKENS
        ]
        for ordinal, (expand_x, shared, _, _, header, counts, _) in enumerate(got):  # arrival order
            sign = 1.0 if ordinal == 0 else -1.0
            rows = max(1, int(counts.sum()))
            ops["async_combine_send"](
                expand_x[:rows] * sign, shared * sign, comm_args, header, 0, seq, H, K, *common, 1, 2, 1, me.names[0]
            )
        me.npu.synchronize()
        headers.append([[int(v) for v in out[4][:3].cpu().tolist()] for out in got])
    return {"headers": headers}


def verdict(name: str, ok: bool, measured: Any, passed: str, failed: str) -> Check:
    """A row that passes or fails, saying why either way."""
    return Check(name, PASS if ok else FAIL, measured, passed if ok else failed)


def camasync_stage_rows(attention: dict[str, Any], ffn: dict[str, Any]) -> list[Check]:
    """The three camasync stage-identity rows from both ranks' measurements (:func:`camasync_stages`).

    ``ffn["headers"][round]`` holds ``[tokens, source rank, layer field]`` per arrival, in arrival
    order; ``attention["cosine"][round]`` the cosine of each stage's combine with its own input.
    """
    rounds = len(STAGE_LAYERS)
    headers, cosines = ffn.get("headers", []), attention.get("cosine", [])
    sent_tokens = [list(STAGE_TOKENS)] * rounds
    sent_fields = [[2 * layer + s for s in range(len(STAGE_TOKENS))] for layer in STAGE_LAYERS]
    got_tokens = [[h[0] for h in rnd] for rnd in headers]
    got_sources = sorted({h[1] for rnd in headers for h in rnd})
    got_fields = [[h[2] for h in rnd] for rnd in headers]
    dispatch, combine, field = STAGE_CHECKS["camasync"]
    return [
        verdict(
            dispatch,
            len(headers) == rounds and got_tokens == sent_tokens and got_sources == [0],
            {"sent_tokens": sent_tokens, "received_tokens": got_tokens, "sources": got_sources},
            "one source's dispatches of one layer arrived in issue order (stage 0 then stage 1) in every round: "
            "the FFN's ordinal stage inference holds",
            "arrivals out of issue order (or from an unexpected source): "
            "a payload's ordinal does not give its stage on this stack",
        ),
        verdict(
            combine,
            len(cosines) == rounds and all(len(c) == 2 and c[0] > COSINE and c[1] < -COSINE for c in cosines),
            {"cosine": cosines, "threshold": COSINE},
            f"each stage's combine came back to its own dispatch (cosine > {COSINE} for stage 0, "
            f"< -{COSINE} for stage 1, whose rows the FFN negated)",
            "combines did not come back in dispatch order (or combine is not a positive-weighted sum "
            "of the rows sent back, which this check assumes)",
        ),
        verdict(
            field,
            len(headers) == rounds and got_fields == sent_fields,
            {"sent": sent_fields, "received": got_fields},
            "the header's layer field returned the value sent (2 * layer + stage): it can carry the stage",
            "the header's layer field did not return the value sent: it cannot carry the stage",
        ),
    ]


def camp2p_stage_row(arrived_on_own_group: bool, groups: int) -> Check:
    """The camp2p stage-identity row: stage ``s`` travels on HCCL group ``s``."""
    return verdict(
        STAGE_CHECKS["camp2p"][0],
        arrived_on_own_group,
        {"groups": groups, "arrived_on_own_group": arrived_on_own_group},
        "two stages in flight, each on its own HCCL group: each arrived intact on its own group, both directions",
        "a stage's payload did not arrive intact on its own group",
    )


def skipped_rows(family: str, why: str) -> list[Check]:
    return [Check(name, SKIPPED, None, f"skipped: {why}") for name in STAGE_CHECKS[family]]
