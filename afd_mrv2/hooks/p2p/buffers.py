"""torch_p2p's host message buffers with their views made once: :class:`HeaderSlot`, :class:`DispatchBuffer`,
:class:`CombineBuffer`, :class:`Prefixes`.

Each torch view (a slice, a ``view`` of another dtype or shape) costs one to a few microseconds, several times
that with the cold caches next to a model's compute (docs/benchmarks-vllm.md); a buffer here makes the views of
a token count once and keeps them, and reads or writes its header with one ``struct`` call on a memoryview.  A
decode step asks the same count at every layer; a buffer keeps the views of :data:`KEPT_COUNTS` counts, then
starts over.  Plain attributes, no ``__slots__``: the executor's buffer report walks them
(``afd_mrv2.pipeline.buffer_bytes``).  See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.buffers".
"""

from __future__ import annotations

from typing import Generic, Literal, NamedTuple, TypeVar

import torch

from afd_mrv2.hooks.p2p import wire

#: how many token counts' views a buffer keeps before it drops them all
KEPT_COUNTS = 64

_V = TypeVar("_V")


class HeaderSlot:
    """A header's :data:`~wire.HEADER_WORDS` int64 words in a contiguous host tensor (``tensor``: what is sent or
    received), read and written through one memoryview (:func:`wire.host_bytes`) made here."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.int64 or tensor.numel() != wire.HEADER_WORDS:
            raise ValueError(f"a header is {wire.HEADER_WORDS} int64 words, got {tensor.numel()} {tensor.dtype}")
        self.tensor = tensor
        self._bytes = wire.host_bytes(tensor)

    def words(self) -> tuple[int, ...]:
        """The words as they are now, in wire order (:attr:`wire.Header.words`)."""
        return wire.WORDS.unpack_from(self._bytes)

    def write(self, words: tuple[int, ...]) -> None:
        wire.WORDS.pack_into(self._bytes, 0, *words)


class _ByCount(Generic[_V]):
    """What :meth:`_make` gives for a token count, made once per count (at most :data:`KEPT_COUNTS` kept)."""

    def __init__(self) -> None:
        self._made: dict[int, _V] = {}

    def at(self, tokens: int) -> _V:
        made = self._made.get(tokens)
        if made is None:
            if len(self._made) >= KEPT_COUNTS:
                self._made = {}
            made = self._made[tokens] = self._make(tokens)
        return made

    def _make(self, tokens: int) -> _V:
        raise NotImplementedError


class Prefixes(_ByCount[torch.Tensor]):
    """``tensor[:n]``, made once per ``n``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor = tensor

    def _make(self, tokens: int) -> torch.Tensor:
        return self.tensor[:tokens]


#: up to how many ids :func:`id_range` reads in Python (ints of a memoryview: about 12 us for 256 with cold caches,
#: 6 warm) rather than with a torch reduction (about 30 us cold, 2.5 warm, whatever the count)
SCAN_IDS = 256


class DispatchViews(NamedTuple):
    """A dispatch payload of ``n`` rows in a staging buffer: the message (its ``nbytes(n)`` bytes) and its blocks
    (:meth:`wire.DispatchLayout.views`; ``scales`` None in the float layout); ``id_words``: the ids' int32 words."""

    message: torch.Tensor
    hidden: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    scales: torch.Tensor | None
    id_words: memoryview


class DispatchBuffer(_ByCount[DispatchViews]):
    """A uint8 staging buffer of dispatch payloads in ``layout``; ``at(n)``: the views of ``n`` rows."""

    def __init__(self, tensor: torch.Tensor, layout: wire.DispatchLayout) -> None:
        super().__init__()
        self.tensor, self.layout = tensor, layout
        self._bytes = wire.host_bytes(tensor)

    def _make(self, tokens: int) -> DispatchViews:
        layout, tensor = self.layout, self.tensor
        scales = None if layout.quant is None else layout.scales(tensor, tokens)
        hidden, weights, ids = layout.views(tensor, tokens)
        start = ids.data_ptr() - tensor.data_ptr()
        id_words = self._bytes[start : start + ids.numel() * 4].cast("i")
        return DispatchViews(tensor[: layout.nbytes(tokens)], hidden, weights, ids, scales, id_words)


_ID_FORMATS: dict[torch.dtype, Literal["q", "i"]] = {torch.int64: "q", torch.int32: "i"}


def id_range(ids: torch.Tensor, words: memoryview | None = None) -> tuple[int, int]:
    """The least and the greatest of ``ids`` (at least one): read in Python up to :data:`SCAN_IDS` of them
    (``words``: their words, else those of a contiguous host tensor of int32 or int64), else by one torch
    reduction."""
    if words is None and ids.numel() <= SCAN_IDS and ids.is_cpu and ids.is_contiguous():
        fmt = _ID_FORMATS.get(ids.dtype)
        if fmt is not None:
            words = wire.host_bytes(ids).cast(fmt)
    if words is not None and len(words) <= SCAN_IDS:
        return min(words), max(words)
    low, high = torch.aminmax(ids)
    return int(low), int(high)


class CombineViews(NamedTuple):
    """A combine message of ``n`` rows: the message (header and rows, :func:`wire.combine_nbytes`) and its rows."""

    message: torch.Tensor
    rows: torch.Tensor


class CombineBuffer(_ByCount[CombineViews]):
    """A uint8 buffer of combine messages (header | fp32 rows [n, ``hidden_size``]): ``header`` its
    :class:`HeaderSlot`, ``at(n)`` the views of ``n`` rows."""

    def __init__(self, tensor: torch.Tensor, hidden_size: int) -> None:
        super().__init__()
        self.tensor, self.hidden_size = tensor, hidden_size
        self.header = HeaderSlot(wire.header_view(tensor))

    @classmethod
    def empty(cls, hidden_size: int, tokens: int) -> CombineBuffer:
        """A new buffer for up to ``tokens`` rows."""
        return cls(torch.empty(wire.combine_nbytes(hidden_size, tokens), dtype=torch.uint8), hidden_size)

    def _make(self, tokens: int) -> CombineViews:
        message = self.tensor[: wire.combine_nbytes(self.hidden_size, tokens)]
        return CombineViews(message, wire.combine_rows(self.tensor, self.hidden_size, tokens))
