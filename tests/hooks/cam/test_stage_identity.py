"""Stage identity on the CAM doubles: a rank that split a step differently fails loudly, naming both sides.

The doubles carry each transfer's stage identity (layer, stage i of n) in their
payload metadata, the side channel the connectors stamp before a send operator
and check after a receive operator (``afd_mrv2.hooks.cam.stage_tags``).  Each
scenario runs real connectors on both roles with a deliberate disagreement:

* the attention rank splits every step into two stages, the FFN rank runs it
  unsplit (one stage): without the check CAMAsync would take stage 0 of 2 for
  stage 0 of 1 (the ordinal rule), CAMP2P would read stage 0's HCCL group alike;
* the attention rank issues each layer's stages in the other order (CAMAsync), or
  maps its stages to the HCCL groups the other way round (CAMP2P);
* an FFN rank answers a combine with another identity than the dispatch had
  (the attention side's check of the combine direction).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from afd_mrv2.errors import PipelineError
from afd_mrv2.hooks.cam.stage_tags import STAGE_TAGS_RESOURCE, StageMismatch, StageTags
from afd_mrv2.items import WorkItem
from afd_mrv2.probe import cluster
from afd_mrv2.probe.cluster import ClusterSpec, RankResult, run_rank, world_rank
from tests.hooks.cam.harness import MODEL, assert_matches_reference
from tests.support.cam_fabric import Fabric
from tests.support.camasync_doubles import CamAsyncDoubles
from tests.support.camp2p_doubles import CamP2PDoubles
from tests.support.doubles_base import PayloadStageTags


def two_stages(connector: str) -> ClusterSpec:
    return ClusterSpec(connector, batches=((5, 3),), split="token")


def run_pair(
    attention: ClusterSpec,
    ffn: ClusterSpec,
    *,
    resources: dict[tuple[str, int], dict[str, Any]] | None = None,
    ffn_tags: Callable[[PayloadStageTags], StageTags] | None = None,
    timeout_s: float = 10.0,
) -> tuple[dict[tuple[str, int], RankResult], list[BaseException], PayloadStageTags]:
    """Both roles on one fabric, each with its own spec (so each its own stage count); every error is kept.

    ``ffn_tags`` wraps the doubles' side channel for the FFN ranks (passed as resource ``cam_stage_tags``).
    """
    fabric = Fabric(timeout_s=timeout_s)
    doubles = (CamP2PDoubles if attention.connector == "camp2p" else CamAsyncDoubles)(fabric)
    results: dict[tuple[str, int], RankResult] = {}
    errors: list[BaseException] = []

    def one(role: str, rank: int) -> None:
        spec = attention if role == "attention" else ffn
        ops = doubles.opset(world_rank(spec, role, rank), evidence=None)
        try:
            extra = dict((resources or {}).get((role, rank), {}))
            if role == "ffn" and ffn_tags is not None:
                extra[STAGE_TAGS_RESOURCE] = ffn_tags(doubles.stage_tags)
            results[(role, rank)] = run_rank(spec, MODEL, role, rank, ops=ops, resources=extra)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            errors.append(exc)
            fabric.abort()

    threads = [
        threading.Thread(target=one, args=(role, rank), daemon=True)
        for role, count in (("attention", attention.num_attention), ("ffn", attention.num_ffn))
        for rank in range(count)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3)
    doubles.close()
    assert not any(t.is_alive() for t in threads), "a rank hung instead of failing"
    return results, errors, doubles.stage_tags


def mismatch(errors: list[BaseException]) -> StageMismatch:
    """The StageMismatch behind the first failure (the other ranks fail because it aborted the fabric)."""
    found = [e.__cause__ for e in errors if isinstance(e, PipelineError) and isinstance(e.__cause__, StageMismatch)]
    assert found, f"no stage identity mismatch among {[f'{type(e).__name__}: {e}' for e in errors]}"
    return found[0]


@pytest.mark.parametrize(
    ("connector", "sender", "receiver"),
    [
        ("camasync", "attention rank 0 (CAM world rank 0)", "FFN rank 0 (CAM world rank 1)"),
        ("camp2p", "attention rank 0 (CAMP2P world rank 1)", "FFN rank 0 (CAMP2P world rank 0)"),
    ],
)
def test_two_stages_against_one_fails_naming_both_ranks_and_both_identities(
    connector: str, sender: str, receiver: str
) -> None:
    """The attention rank split the step (2 stages), the FFN rank ran it unsplit (1 stage)."""
    split = two_stages(connector)
    _, errors, _ = run_pair(split, replace(split, split=None))
    error = mismatch(errors)
    assert (str(error.sender), str(error.expected)) == ("layer=0 stage 0 of 2", "layer=0 stage 0 of 1")
    text = str(error)
    assert f"{connector}: stage identity mismatch" in text
    assert f"{sender} sent layer=0 stage 0 of 2, but {receiver} expects layer=0 stage 0 of 1" in text


def test_camasync_stages_issued_in_the_other_order_fail_naming_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention rank dispatches each layer's stage 1 before its stage 0; the ordinal rule would
    silently take stage 1's rows for stage 0."""
    straight = cluster.attention_items

    def swapped(num_layers: int, num_stages: int, *, first_seq: int = 0) -> Iterator[WorkItem]:
        items = list(straight(num_layers, num_stages, first_seq=first_seq))
        for i in range(0, len(items), 2):  # same seq numbering, stages swapped within each layer
            a, b = items[i], items[i + 1]
            yield WorkItem(b.layer_idx, b.stage_idx, a.seq, num_stages=2)
            yield WorkItem(a.layer_idx, a.stage_idx, b.seq, num_stages=2)

    spec = two_stages("camasync")
    monkeypatch.setattr(cluster, "attention_items", swapped)  # the FFN rank uses ffn_items: unchanged
    _, errors, _ = run_pair(spec, spec)
    error = mismatch(errors)
    assert (str(error.sender), str(error.expected)) == ("layer=0 stage 1 of 2", "layer=0 stage 0 of 2")
    assert (
        "attention rank 0 (CAM world rank 0) sent layer=0 stage 1 of 2, but FFN rank 0 (CAM world rank 1) "
        "expects layer=0 stage 0 of 2" in str(error)
    )


def test_camp2p_stages_on_swapped_hccl_groups_fail_naming_both_sides() -> None:
    """The attention rank maps stage 0 to the FFN rank's stage-1 group and back: the group alone would
    make the FFN rank take stage 1's rows for stage 0."""
    spec = two_stages("camp2p")
    resources = {("attention", 0): {"hccl_groups": ("afd1", "afd0")}}
    _, errors, _ = run_pair(spec, spec, resources=resources)
    error = mismatch(errors)
    assert (str(error.sender), str(error.expected)) == ("layer=0 stage 1 of 2", "layer=0 stage 0 of 2")
    assert (
        "attention rank 0 (CAMP2P world rank 1) sent layer=0 stage 1 of 2, but FFN rank 0 (CAMP2P world rank 0) "
        "expects layer=0 stage 0 of 2" in str(error)
    )


@dataclass
class Misstamping:
    """An FFN rank's side channel that stamps its combines as stage ``i of 3``: the attention side must notice."""

    inner: PayloadStageTags

    def stamp(self, sender: int, stage: WorkItem) -> None:
        self.inner.stamp(sender, replace(stage, num_stages=3))

    def take(self, receiver: int, sender: int) -> WorkItem | None:
        return self.inner.take(receiver, sender)


@pytest.mark.parametrize(
    ("connector", "sender", "receiver"),
    [
        ("camasync", "FFN rank 0 (CAM world rank 1)", "attention rank 0 (CAM world rank 0)"),
        ("camp2p", "FFN rank 0 (CAMP2P world rank 0)", "attention rank 0 (CAMP2P world rank 1)"),
    ],
)
def test_a_combine_of_another_stage_fails_on_the_attention_side(connector: str, sender: str, receiver: str) -> None:
    spec = two_stages(connector)
    _, errors, _ = run_pair(spec, spec, ffn_tags=Misstamping)
    error = mismatch(errors)
    assert (str(error.sender), str(error.expected)) == ("layer=0 stage 0 of 3", "layer=0 stage 0 of 2")
    assert f"{sender} sent layer=0 stage 0 of 3, but {receiver} expects layer=0 stage 0 of 2" in str(error)


@pytest.mark.parametrize("connector", ["camasync", "camp2p"])
def test_agreeing_ranks_check_every_transfer_and_match_the_reference(connector: str) -> None:
    spec = replace(two_stages(connector), num_attention=2, num_ffn=2, batches=((5, 3), (2, 2, 4)))
    if connector == "camp2p":
        spec = replace(spec, num_ffn=1)
    results, errors, tags = run_pair(spec, spec)
    assert not errors
    assert_matches_reference({r: res.output for (role, r), res in results.items() if role == "attention"}, spec)
    assert tags.taken > 0 and tags.pending() == 0  # every stamped identity was delivered and checked
