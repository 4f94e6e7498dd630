"""The evidence document (afd-mrv2/evidence/v1): schema checks, the connector's view, round trips."""

from __future__ import annotations

import copy
import json

import pytest

from afd_mrv2.errors import ConfigError
from afd_mrv2.hooks.cam.evidence import (
    SCHEMA,
    Check,
    Evidence,
    OpEvidence,
    Report,
    StreamBehaviour,
    validate,
)
from afd_mrv2.hooks.cam.ops import load_evidence

FOREIGN_RECV = OpEvidence(
    "umdk_cam_op_lib.async_dispatch_recv", True, StreamBehaviour.FOREIGN, "default", True, "escaped the held stream"
)
CURRENT_SEND = OpEvidence("umdk_cam_op_lib.async_combine_send", True, StreamBehaviour.CURRENT)


def evidence() -> Evidence:
    return Evidence(
        {"torch": "2.10.0"},
        {op.qualname: op for op in (FOREIGN_RECV, CURRENT_SEND)},
        {"camasync": {"equal": True, "max_abs_diff": 0.0}},
        (Check("stage-identity:camasync:dispatch-order", "pass", {"received_tokens": [[16, 8]]}, "in order"),),
        context={"host": "npu-host"},
    )


def test_round_trip_through_the_file_and_the_connector_loader(tmp_path) -> None:
    path = evidence().write(tmp_path / "e.json")
    raw = json.loads(path.read_text())
    assert validate(raw) == []
    assert raw["schema"] == SCHEMA and raw["versions"] == {"torch": "2.10.0"}
    rows = {c["name"]: c for c in raw["checks"]}
    assert rows["operator:umdk_cam_op_lib.async_dispatch_recv"]["measured"]["stream"] == "foreign"
    assert rows["operator:umdk_cam_op_lib.async_dispatch_recv"]["status"] == "pass"
    assert rows["comparison:camasync"]["status"] == "pass"
    assert raw["summary"] == {"pass": 4, "fail": 0, "skipped": 0}
    assert Evidence.load(path) == evidence()
    assert load_evidence({"stream_evidence": str(path)}, "k") == evidence()
    assert load_evidence({}, "k") is None


def test_row_status_follows_what_was_established() -> None:
    unverified = OpEvidence("ns.a", True, StreamBehaviour.UNVERIFIED, detail="busy window ended")
    unsafe = OpEvidence("ns.b", True, StreamBehaviour.CURRENT, concurrent_in_flight_safe=False)
    absent = OpEvidence("ns.c", False)
    assert [op.check().status for op in (unverified, unsafe, absent, CURRENT_SEND)] == [
        "fail",
        "fail",
        "skipped",
        "pass",
    ]
    assert absent.check().detail.startswith("skipped: not registered")
    report = Evidence({}, {}, {"x": {"skipped": "no NPU"}, "y": {"equal": False}, "z": "RuntimeError: boom"}).report()
    assert [(c.name, c.status) for c in report.checks] == [
        ("comparison:x", "skipped"),
        ("comparison:y", "fail"),
        ("comparison:z", "fail"),
    ]
    assert report.failed and report.summary == {"pass": 0, "fail": 2, "skipped": 1}


def _doc() -> dict:
    return Report("test", (Check("a", "pass", 1.0, ""), Check("b", "skipped", None, "skipped: no NPU"))).to_json()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d.update(schema="afd-mrv2/cam-probe/v1"), "schema: expected"),
        (lambda d: d.pop("versions"), "missing key 'versions'"),
        (lambda d: d.update(extra=1), "unknown key 'extra'"),
        (lambda d: d["environment"].update(cores=2), "environment: expected an object of strings"),
        (lambda d: d["checks"][0].update(status="ok"), "checks[0].status: expected one of pass, fail, skipped"),
        (lambda d: d["checks"][1].update(detail=""), "a skipped row must say why"),
        (lambda d: d["checks"][1].update(name="a"), "checks[1].name: expected a unique"),
        (lambda d: d["checks"][0].pop("measured"), "checks[0]: expected exactly the keys"),
        (lambda d: d["checks"][0].update(measured=float("nan")), "no NaN"),
        (lambda d: d["summary"].update({"pass": 2}), "summary: expected"),
    ],
)
def test_validate_names_each_departure(change, problem: str) -> None:
    doc = copy.deepcopy(_doc())
    assert validate(doc) == []
    change(doc)
    problems = validate(doc)
    assert problems and problem in problems[0], problems


def test_a_producer_cannot_write_an_invalid_document(tmp_path) -> None:
    with pytest.raises(ValueError, match="must say why"):
        Report("test", (Check("a", "fail", None, ""),)).write(tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.parametrize(
    ("measured", "text"),
    [
        ({"present": True, "stream": "sideways"}, r"stream_evidence.checks\[operator:a.b\].measured.stream"),
        ({"present": True, "stream": "foreign"}, "a foreign operator needs a home"),
        ("current", "expected an object with present, stream"),
    ],
)
def test_bad_operator_rows_are_config_errors(tmp_path, measured, text: str) -> None:
    doc = Report("test", (Check("operator:a.b", "pass", measured, ""),)).to_json()
    path = tmp_path / "e.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=text):
        Evidence.load(path)


def test_unreadable_or_foreign_documents_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read evidence file"):
        Evidence.load(tmp_path / "absent.json")
    (tmp_path / "old.json").write_text(json.dumps({"schema": "afd-mrv2/cam-probe/v1", "operators": {}}))
    with pytest.raises(ConfigError, match="not an afd-mrv2 evidence document"):
        Evidence.load(tmp_path / "old.json")
    with pytest.raises(ConfigError, match="expected a path"):
        load_evidence({"stream_evidence": 3}, "k")
