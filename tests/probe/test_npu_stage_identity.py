"""The NPU probe's stage-identity verdicts, judged on made-up measurements (the measuring needs an NPU)."""

from __future__ import annotations

from afd_mrv2.hooks.cam.evidence import validate
from afd_mrv2.probe import npu
from afd_mrv2.probe import stage_identity as si

A, B = si.STAGE_TOKENS  # stage 0 and stage 1 token counts


def ffn(order: tuple[int, int] = (0, 1), source: int = 0, field=lambda layer, stage: 2 * layer + stage) -> dict:
    """The FFN rank's headers: per round, [tokens, source, layer field] per arrival in arrival order."""
    return {"headers": [[[si.STAGE_TOKENS[s], source, field(layer, s)] for s in order] for layer in si.STAGE_LAYERS]}


def attention(cosines=(0.99, -0.99)) -> dict:
    return {"cosine": [list(cosines) for _ in si.STAGE_LAYERS]}


def verdicts(att: dict, f: dict) -> dict[str, str]:
    return {row.name: row.status for row in si.camasync_stage_rows(att, f)}


DISPATCH, COMBINE, FIELD = si.STAGE_CHECKS["camasync"]


def test_in_order_delivery_passes_every_row() -> None:
    rows = si.camasync_stage_rows(attention(), ffn())
    assert {r.name: r.status for r in rows} == {DISPATCH: "pass", COMBINE: "pass", FIELD: "pass"}
    assert rows[0].measured["received_tokens"] == [[A, B]] * len(si.STAGE_LAYERS)
    assert rows[2].measured["received"][-1] == [2 * si.STAGE_LAYERS[-1], 2 * si.STAGE_LAYERS[-1] + 1]


def test_swapped_arrivals_fail_the_dispatch_order_row() -> None:
    found = verdicts(attention(), ffn(order=(1, 0)))
    assert found[DISPATCH] == "fail" and found[FIELD] == "fail"  # stage 1's field arrived first, too
    assert verdicts(attention(), ffn(source=3))[DISPATCH] == "fail"


def test_combines_back_to_the_wrong_stage_fail_the_combine_row() -> None:
    assert verdicts(attention((-0.99, 0.99)), ffn())[COMBINE] == "fail"
    assert verdicts(attention((0.5, -0.99)), ffn())[COMBINE] == "fail"  # not clearly its own input
    assert verdicts({}, ffn())[COMBINE] == "fail"  # nothing measured is not a pass


def test_a_layer_field_the_operator_rewrites_fails_the_field_row() -> None:
    found = verdicts(attention(), ffn(field=lambda layer, stage: layer))
    assert found == {DISPATCH: "pass", COMBINE: "pass", FIELD: "fail"}


def test_missing_measurements_fail() -> None:
    assert set(verdicts({}, {}).values()) == {"fail"}
    assert si.camp2p_stage_row(False, 2).status == "fail" and si.camp2p_stage_row(True, 2).status == "pass"


def test_without_an_npu_every_row_is_skipped_never_passed() -> None:
    doc = npu.skipped_evidence("no NPU: torch_npu is not installed", {"torch": "2.13.0"}).to_json()
    assert validate(doc) == []
    names = [c["name"] for c in doc["checks"]]
    for checks in si.STAGE_CHECKS.values():
        assert set(checks) <= set(names)
    assert "operator:umdk_cam_op_lib.async_dispatch_recv" in names and "comparison:camp2p" in names
    assert {c["status"] for c in doc["checks"]} == {"skipped"}
    assert all(c["detail"].startswith("skipped: no NPU: torch_npu") for c in doc["checks"])
    assert doc["summary"] == {"pass": 0, "fail": 0, "skipped": len(names)}
