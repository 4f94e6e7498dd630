"""The toy cluster's rank-consistent fallback: one attention rank without a plan makes the whole step unsplit.

Attention rank 1 holds a single request, which the request split cannot cut;
attention rank 0 could split its three requests.  Every rank must run the step
unsplit (one stage), on both CAM connectors, and still match the reference;
deciding per rank would pair rank 0's stage 0 of 2 with rank 1's whole batch.
"""

from __future__ import annotations

import pytest

from afd_mrv2.probe.cluster import ClusterSpec
from tests.hooks.cam.harness import assert_matches_reference, run

BATCHES = ((5, 3, 4), (9,))


@pytest.mark.parametrize("connector", ["camasync", "camp2p"])
def test_a_rank_without_a_plan_makes_every_rank_run_the_step_unsplit(connector: str) -> None:
    spec = ClusterSpec(connector, num_attention=2, num_ffn=2, batches=BATCHES, split="request", multistream=True)
    decision = spec.decision()
    assert not decision.split and decision.why == "attention rank 1 has no two-stage plan (1 request(s), 9 token(s))"
    assert spec.num_stages == 1 and [len(spec.stages(a)) for a in range(2)] == [1, 1]
    assert not spec.config("attention").async_moe.enabled and not spec.config("ffn").async_moe.enabled
    result = run(spec)
    assert_matches_reference(result.outputs(), spec)


def test_every_rank_splits_when_every_rank_can() -> None:
    spec = ClusterSpec("camasync", num_attention=2, batches=((5, 3, 4), (9, 2)), split="request")
    assert spec.decision().split and spec.num_stages == 2 and spec.config("ffn").async_moe.enabled
    assert_matches_reference(run(spec).outputs(), spec)
