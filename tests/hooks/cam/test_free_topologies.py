"""Free topologies on the CAM connectors: CAMAsync shards experts over the FFN ranks, so any
A x F works (3A2F, 1A2F on the doubles, equal to the reference); CAMP2P's a2e/e2a pair each
FFN rank with A/F attention ranks, so it refuses an F that does not divide A, in one line."""

from __future__ import annotations

import pytest

from afd_mrv2.probe.cluster import ClusterSpec
from tests.hooks.cam.harness import assert_matches_reference, run
from tests.hooks.cam.test_config_refusals import build, camp2p, refused


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    ("attention", "ffn", "batches"), [(3, 2, ((5, 3, 4), (9,), (2, 7))), (1, 2, ((5, 3, 4),))], ids=["3A2F", "1A2F"]
)
def test_camasync_free_topology_matches_the_reference(attention: int, ffn: int, batches: tuple) -> None:
    spec = ClusterSpec("camasync", num_attention=attention, num_ffn=ffn, batches=batches, split="token")
    result = run(spec)
    assert sorted(result.outputs()) == list(range(attention))
    assert_matches_reference(result.outputs(), spec)


@pytest.mark.parametrize(("attention", "ffn"), [(3, 2), (1, 2)], ids=["3A2F", "1A2F"])
def test_camp2p_refuses_an_ffn_count_that_does_not_divide_attention(attention: int, ffn: int) -> None:
    error = refused(
        camp2p(num_attention_ranks=attention, num_ffn_ranks=ffn),
        f"expected a divisor of num_attention_ranks ({attention}), got {ffn}",
    )
    assert error.key == "afd.num_ffn_ranks"


def test_camp2p_accepts_a_divisor() -> None:
    assert build(camp2p(num_attention_ranks=4, num_ffn_ranks=2)).per_ffn == 2
