"""Acceptance: an operator that ignores the caller's stream is detected and fenced, outputs stay equal.

The stream-ignoring doubles run their effect on their own worker thread after a
lag: the call returns before the outputs exist.  The start-up probe classifies
them FOREIGN, the connector's BoundOp brackets exactly those calls with the
fence, and the results equal the well-behaved doubles'.  Without the fence
(evidence that wrongly claims "current") the same run breaks.
"""

from __future__ import annotations

import pytest
import torch

from afd_mrv2.errors import ConfigError, PipelineError
from afd_mrv2.hooks.cam.evidence import Evidence, OpEvidence, StreamBehaviour
from afd_mrv2.probe.cluster import ClusterSpec, reference
from tests.hooks.cam.harness import MODEL, assert_matches_reference, run
from tests.support.cam_fabric import DelayEveryOther
from tests.support.happens_before import check_happens_before

SPECS = {
    "camp2p": ClusterSpec("camp2p", num_attention=2, num_ffn=2, batches=((5, 3, 4), (9,))),
    "camasync": ClusterSpec("camasync", num_attention=2, num_ffn=2, batches=((5, 3, 4), (9,))),
}
ALL = {
    "camp2p": ("a2e", "e2a"),
    "camasync": ("async_dispatch_send", "async_dispatch_recv", "async_combine_send", "async_combine_recv"),
}
# one operator per role's recv or send phase, never both phases of one role (see below)
RECV_SIDE = {"camp2p": ("a2e",), "camasync": ("async_dispatch_recv", "async_combine_recv")}
SEND_SIDE = {"camp2p": ("e2a",), "camasync": ("async_dispatch_send", "async_combine_send")}


def spec_for(name: str, multistream: bool) -> ClusterSpec:
    return ClusterSpec(**{**SPECS[name].__dict__, "multistream": multistream})


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# "all" + multistream is refused at start-up: see test_both_phases_on_one_home_refuse_multistream
MODES = [("recv-side", True), ("send-side", True), ("recv-side", False), ("all", False)]


@pytest.mark.parametrize("backend", ["host", "recording"])
@pytest.mark.parametrize(("foreign", "multistream"), MODES, ids=[f"{f}-{'multi' if m else 'serial'}" for f, m in MODES])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_probe_detects_and_the_fence_keeps_outputs_equal(
    name: str, foreign: str, multistream: bool, backend: str
) -> None:
    ops = {"recv-side": RECV_SIDE, "send-side": SEND_SIDE, "all": ALL}[foreign][name]
    spec = ClusterSpec(**{**spec_for(name, multistream).__dict__, "backend": backend})
    delay = DelayEveryOther("dispatch", 0.02) if name == "camasync" else None
    honest = run(spec, delay=delay)
    ignoring = run(spec, foreign=ops, delay=delay)
    assert {e.stream for e in honest.evidence.operators.values()} == {StreamBehaviour.CURRENT}
    found = {q.split(".")[1] for q, e in ignoring.evidence.operators.items() if e.stream is StreamBehaviour.FOREIGN}
    assert found == set(ops), "the probe finds exactly the stream-ignoring operators"
    for rank, out in honest.outputs().items():
        assert torch.equal(out, ignoring.outputs()[rank])
    assert_matches_reference(ignoring.outputs(), spec)
    fenced = 0
    for connector in ignoring.connectors():
        for op_name, op in connector.ops.ops.items():
            assert op.fenced_calls == (op.calls if op_name in ops else 0), (op_name, op.calls, op.fenced_calls)
            fenced += op.fenced_calls
    assert fenced > 0
    for connector in honest.connectors():
        assert all(op.fenced_calls == 0 for op in connector.ops.ops.values())
    if backend == "recording":
        for result in ignoring.results.values():
            check_happens_before(result.backend.log, host_edges=False)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_both_phases_on_one_home_refuse_multistream(name: str) -> None:
    with pytest.raises(ConfigError, match=r"afd.multistream.enabled: .*share one home stream"):
        run(spec_for(name, True), foreign=ALL[name])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_without_the_fence_the_run_breaks(name: str) -> None:
    ops = RECV_SIDE[name]
    lie = Evidence(
        {},
        {
            f"{ns}.{op}": OpEvidence(f"{ns}.{op}", True, StreamBehaviour.CURRENT)
            for ns in ("afd_ascend", "umdk_cam_op_lib")
            for op in ALL[name]
        },
    )
    spec = spec_for(name, True)
    try:
        result = run(spec, foreign=ops, evidence=lie, lag_s=0.05, timeout_s=3.0)
    except PipelineError as exc:  # an unfenced operator's outputs were read before they existed
        symptoms = ("inconsistent header", "nan", "rows", "no stage identity (none was delivered")
        assert any(s in str(exc) or s in str(exc).lower() for s in symptoms), exc
        return
    expected = reference(spec, MODEL)
    assert any(not torch.allclose(out, expected[rank], atol=1e-5) for rank, out in result.outputs().items())
