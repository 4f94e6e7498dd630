"""torch_p2p's message buffers: the views made once per token count are the layout's, the header slot reads and
writes the wire's words, and the id range read in Python is the torch reduction's."""

from __future__ import annotations

import pytest
import torch

from afd_mrv2.hooks.p2p import buffers, wire
from afd_mrv2.hooks.p2p.buffers import CombineBuffer, DispatchBuffer, HeaderSlot, Prefixes, id_range
from afd_mrv2.items import WorkItem


@pytest.mark.parametrize("quant", [None, "w8a8"])
def test_dispatch_views_are_the_layouts_and_made_once_per_count(quant: str | None) -> None:
    layout = wire.DispatchLayout(hidden_size=6, top_k=2, quant=quant)
    staging = DispatchBuffer(torch.zeros(layout.nbytes(8), dtype=torch.uint8), layout)
    views = staging.at(3)
    assert staging.at(3) is views
    assert views.message.data_ptr() == staging.tensor.data_ptr() and views.message.numel() == layout.nbytes(3)
    for mine, theirs in zip(views[1:4], layout.views(staging.tensor, 3), strict=True):
        assert (mine.data_ptr(), mine.shape, mine.dtype) == (theirs.data_ptr(), theirs.shape, theirs.dtype)
    if quant is None:
        assert views.scales is None
    else:
        assert views.scales is not None and views.scales.data_ptr() == layout.scales(staging.tensor, 3).data_ptr()
    views.ids.copy_(torch.tensor([[0, 3], [2, -1], [7, 5]]))
    assert list(views.id_words) == [0, 3, 2, -1, 7, 5]


def test_a_buffer_that_saw_many_counts_starts_over_and_stays_right() -> None:
    layout = wire.DispatchLayout(hidden_size=4, top_k=1)
    staging = DispatchBuffer(torch.zeros(layout.nbytes(200), dtype=torch.uint8), layout)
    for tokens in range(buffers.KEPT_COUNTS + 10):
        views = staging.at(tokens)
        assert views.hidden.shape == (tokens, 4) and views.message.numel() == layout.nbytes(tokens)
    assert staging.at(5).hidden.shape == (5, 4)


def test_a_combine_buffer_header_and_rows() -> None:
    message = CombineBuffer.empty(hidden_size=4, tokens=3)
    header = wire.item_header(wire.KIND_COMBINE, 2, 0, WorkItem(1, 0, 7), 2)
    message.header.write(header.words)
    assert message.header.words() == header.words
    assert wire.Header.read(wire.header_view(message.tensor)) == header
    views = message.at(2)
    views.rows.copy_(torch.arange(8.0).view(2, 4))
    assert views.message.numel() == wire.combine_nbytes(4, 2)
    assert torch.equal(wire.combine_rows(message.tensor, 4, 2), torch.arange(8.0).view(2, 4))


def test_a_header_slot_is_nine_int64_words() -> None:
    words = torch.zeros(2, wire.HEADER_WORDS, dtype=torch.int64)
    slot = HeaderSlot(words[1])
    slot.write(tuple(range(-4, 5)))
    assert words[1].tolist() == list(range(-4, 5)) and words[0].tolist() == [0] * wire.HEADER_WORDS
    with pytest.raises(ValueError, match="9 int64 words"):
        HeaderSlot(torch.zeros(wire.HEADER_WORDS, dtype=torch.int32))


def test_prefixes_are_views_of_the_tensor() -> None:
    rows = Prefixes(torch.arange(10))
    assert rows.at(4).tolist() == [0, 1, 2, 3] and rows.at(4) is rows.at(4) and rows.at(0).numel() == 0
    rows.tensor[0] = 9
    assert rows.at(4).tolist() == [9, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.bool])
@pytest.mark.parametrize("count", [1, 7, buffers.SCAN_IDS, buffers.SCAN_IDS + 1, 4 * buffers.SCAN_IDS])
def test_the_id_range_is_the_torch_reductions(dtype: torch.dtype, count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    ids = torch.randint(-5, 300, (count, 1), generator=gen).to(dtype)
    want = (int(ids.min()), int(ids.max()))
    assert id_range(ids) == want
    assert id_range(torch.cat([ids, ids], dim=1)[:, :1]) == want  # not contiguous: torch reads it
    if dtype == torch.int32:
        assert id_range(ids, wire.host_bytes(ids).cast("i")) == want
