"""Stage pairing: the pending FIFO and the work-item schedules."""

from __future__ import annotations

import pytest

from afd_mrv2.errors import ConfigError
from afd_mrv2.items import WorkItem
from afd_mrv2.stages import PairingError, PendingFifo, attention_items, ffn_items
from afd_mrv2.stages.pairing import attention_buffers, check_attention_depth


def test_fifo_within_a_key_and_independent_keys() -> None:
    fifo: PendingFifo[str] = PendingFifo("test", limit=8)
    fifo.push(WorkItem.stage(0, 0), "a")
    fifo.push(WorkItem.stage(0, 1), "b")
    fifo.push(WorkItem.stage(0, 0), "c")
    assert fifo.pop(WorkItem.stage(0, 1)) == "b"
    assert fifo.pop(WorkItem.stage(0, 0)) == "a"
    assert fifo.pop(WorkItem.stage(0, 0)) == "c"
    assert len(fifo) == 0 and fifo.pop_or_none(WorkItem.stage(0, 0)) is None


def test_missing_key_names_what_is_pending() -> None:
    fifo: PendingFifo[int] = PendingFifo("dispatches", limit=4)
    fifo.push(WorkItem.stage(1, 0), 1)
    with pytest.raises(
        PairingError, match=r"dispatches: nothing pending for layer=0 stage 1 of 1 \(pending: layer=1 stage 0 of 1\)"
    ):
        fifo.pop(WorkItem.stage(0, 1))


def test_limit_bounds_outstanding_transfers() -> None:
    fifo: PendingFifo[int] = PendingFifo("arrivals", limit=2)
    fifo.push(WorkItem.stage(0, 0), 1)
    fifo.push(WorkItem.stage(0, 1), 2)
    with pytest.raises(PairingError, match="more than 2 transfers outstanding"):
        fifo.push(WorkItem.stage(1, 0), 3)
    assert fifo.clear() == 2 and fifo.keys() == []


def test_schedules() -> None:
    items = list(attention_items(2, 2))
    assert [(i.layer_idx, i.stage_idx) for i in items] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [i.seq for i in items] == list(range(6))
    # with depth == stages, item k and k - depth are the same stage, consecutive layers
    for k in range(2, len(items)):
        assert items[k].stage_idx == items[k - 2].stage_idx and items[k].layer_idx == items[k - 2].layer_idx + 1
    ffn = list(ffn_items(2, 2, sources=2, first_seq=10))
    assert [(i.layer_idx, i.stage_idx) for i in ffn] == [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    assert ffn[0].seq == 10


def test_attention_buffer_counts_must_sum_to_at_most_the_stages_when_pipelined() -> None:
    # recv(k) follows send(k - inputs - outputs) only; the pairing needs send(k - stages)
    check_attention_depth((1, 1), 2, pipelined=True)
    check_attention_depth((3, 3), 2, pipelined=False)  # serialized: one stream, no edge needed
    assert attention_buffers(2) == (1, 1) and attention_buffers(1) is None
    for counts in ((2, 2), (2, 1), (1, 2)):
        with pytest.raises(ConfigError, match=r"afd.multistream.depth: .* at most the number of stages \(2\)"):
            check_attention_depth(counts, 2, pipelined=True)
    with pytest.raises(ConfigError, match=r"afd.multistream.buffers: .*with one stage no counts do"):
        check_attention_depth((1, 1), 1, pipelined=True, key="afd.multistream.buffers")
