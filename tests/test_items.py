"""afd-mrv2's one item and stage identity (WorkItem) and its one text form."""

from __future__ import annotations

import pytest
import torch

from afd_mrv2.hooks.p2p import wire
from afd_mrv2.hooks.p2p.errors import ProtocolError
from afd_mrv2.items import ANY_SEQ, WorkItem


def test_an_item_and_its_stage_identity_have_one_text_form_each():
    item = WorkItem(3, 1, 17, num_stages=2)
    assert str(item) == "layer=3 stage=1 seq=17"
    assert item.stage_id == WorkItem.stage(3, 1, 2) and item.stage_id.seq == ANY_SEQ
    assert str(item.stage_id) == "layer=3 stage 1 of 2"


def test_a_stage_identity_keys_by_layer_and_stage_and_compares_its_stage_count_on_request():
    keys = {WorkItem.stage(0, 1): "a"}
    assert keys[WorkItem(0, 1, 99, num_stages=2).stage_id] == "a"  # a key: (layer, stage), whatever the seq
    assert WorkItem.stage(0, 0, 2).same_stage(WorkItem(0, 0, 5, num_stages=2))
    assert not WorkItem.stage(0, 0, 2).same_stage(WorkItem.stage(0, 0, 1))  # stage 0 of 2 is not stage 0 of 1
    assert not WorkItem.stage(0, 0, 2).same_stage(None)


def test_the_wire_header_carries_the_item_and_names_it_in_the_same_form():
    item = WorkItem(2, 1, 40, num_stages=2)
    header = wire.item_header(wire.KIND_DISPATCH, 0, 1, item, tokens=8)
    words = torch.empty(wire.HEADER_WORDS, dtype=torch.int64)
    header.write(words)
    back = wire.Header.read(words)
    assert back.item == item and back.item.num_stages == 2
    assert back.names() == "layer=2 stage 1 of 2 (seq=40)"
    with pytest.raises(ProtocolError) as bad:
        wire.validate_header(
            wire.item_header(wire.KIND_DISPATCH, 0, 1, WorkItem(2, 0, 40, num_stages=1), tokens=8),
            header,
            peer_name="attention rank 0",
            what="dispatch",
            me="FFN rank 0",
        )
    assert "attention rank 0 sent layer=2 stage 0 of 1 (seq=40), but FFN rank 0 expects layer=2 stage 1 of 2" in str(
        bad.value
    )


def test_the_old_stage_identity_names_still_work_with_a_deprecation_warning():
    import afd_mrv2.ubatch
    from afd_mrv2.hooks.cam import stage_tags

    with pytest.warns(DeprecationWarning, match=r"StageKey is deprecated since hook API 1: use afd_mrv2.WorkItem"):
        key = afd_mrv2.ubatch.StageKey(0, 1)
    with pytest.warns(DeprecationWarning, match=r"StageId is deprecated since hook API 1: use afd_mrv2.WorkItem"):
        stage = stage_tags.StageId(0, 1, 2)
    assert key == WorkItem.stage(0, 1) and str(stage) == "layer=0 stage 1 of 2"
