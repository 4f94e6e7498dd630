"""The torch_p2p wire format: tags, the typed control header, payload layouts.

:func:`validate_header` raises :class:`ProtocolError` naming the peer and the first wrong field.

See docs/internals/p2p-transport.md, "afd_mrv2.hooks.p2p.wire".
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from afd_mrv2.hooks.p2p.errors import ProtocolError
from afd_mrv2.items import WorkItem

MAGIC = 0x4146_4432_5032_0002  # "AFD2" "P2" version 2 (version 1 had no ``stages``)
VERSION = MAGIC & 0xFFFF
FIELDS = ("magic", "kind", "src", "dst", "layer", "stage", "stages", "seq", "tokens")
#: the fields that together are a message's stage identity (checked as one, named both sides)
STAGE_FIELDS = ("stage", "stages")
HEADER_WORDS = len(FIELDS)
HEADER_BYTES = HEADER_WORDS * 8
#: the header's words in the host's byte order, as torch holds them
WORDS = struct.Struct(f"={HEADER_WORDS}q")

KIND_DISPATCH = 1
KIND_COMBINE = 2
KIND_ABORT = 3
KIND_BYE = 4
#: a dispatch whose hidden rows are per-token int8 with float32 scales (option ``quant: w8a8``); a
#: different kind, so that ranks configured differently fail on the header, not on the payload size
KIND_DISPATCH_W8A8 = 5
#: a re-send of the lost FFN rank's share of an item to a live holder (see docs/internals/p2p-transport.md)
KIND_REDISPATCH = 6
KIND_REDISPATCH_W8A8 = 7
KIND_NAMES = {
    KIND_DISPATCH: "dispatch",
    KIND_COMBINE: "combine",
    KIND_ABORT: "abort",
    KIND_BYE: "bye",
    KIND_DISPATCH_W8A8: "dispatch-w8a8",
    KIND_REDISPATCH: "redispatch",
    KIND_REDISPATCH_W8A8: "redispatch-w8a8",
}

TAG_DISPATCH_HEADER = 0x0A01
TAG_DISPATCH_PAYLOAD = 0x0A02
TAG_COMBINE = 0x0A03
TAG_CONTROL = 0x0A0F

CONTROL_TEXT_BYTES = 448
CONTROL_BYTES = HEADER_BYTES + CONTROL_TEXT_BYTES


@dataclass(frozen=True)
class Header:
    """The decoded control header of one message."""

    kind: int
    src: int
    dst: int
    layer: int
    stage: int
    seq: int
    tokens: int
    stages: int = 1
    magic: int = MAGIC

    def write(self, out: torch.Tensor) -> None:
        """Write into ``out``: an int64 tensor of :data:`HEADER_WORDS` elements.

        A contiguous host tensor is written with one ``struct.pack_into`` (no torch call: next to a model's
        compute, with cold caches, a ``torch.tensor`` + ``copy_`` measured 72 us against 36 us this way, and 7
        against 3 warm; docs/benchmarks-vllm.md); any other through torch.
        """
        if (
            out.device.type == "cpu"
            and out.is_contiguous()
            and out.dtype == torch.int64
            and out.numel() == HEADER_WORDS
        ):
            WORDS.pack_into(host_bytes(out), 0, *self.words)
            return
        out.copy_(torch.tensor(self.words, dtype=torch.int64))

    @property
    def words(self) -> tuple[int, ...]:
        """The header's values in wire order (:data:`FIELDS`)."""
        return (self.magic, self.kind, self.src, self.dst, self.layer, self.stage, self.stages, self.seq, self.tokens)

    @classmethod
    def read(cls, words: torch.Tensor) -> Header:
        return cls.from_words(tuple(int(v) for v in words.tolist()))

    @classmethod
    def from_words(cls, words: tuple[int, ...]) -> Header:
        """The header of :data:`HEADER_WORDS` values in wire order (:data:`FIELDS`, as :attr:`words` gives them)."""
        magic, kind, src, dst, layer, stage, stages, seq, tokens = words
        return cls(kind, src, dst, layer, stage, seq, tokens, stages, magic)

    @property
    def item(self) -> WorkItem:
        """The work item this header carries (afd-mrv2's one item identity, :class:`WorkItem`)."""
        return WorkItem(self.layer, self.stage, self.seq, max(self.stages, 1))

    def names(self) -> str:
        """The item's identity in its one text form, with its stage count: ``layer=L stage S of N (seq=Q)``."""
        return f"{self.item.stage_id} (seq={self.seq})"


def item_header(kind: int, src: int, dst: int, item: WorkItem, tokens: int) -> Header:
    """The header of ``item``'s ``kind`` message from global rank ``src`` to ``dst``.

    Carries ``item.num_stages`` as ``stages``; an item whose stage index is not
    below its stage count is the owner's bug and raises here, before it reaches a peer.
    """
    return Header.from_words(item_words(kind, src, dst, item, tokens))


def item_words(kind: int, src: int, dst: int, item: WorkItem, tokens: int, seq: int | None = None) -> tuple[int, ...]:
    """:func:`item_header`'s :attr:`Header.words` (no Header built), with the same check; ``seq`` replaces the
    item's (a message's number on its pair, see docs/internals/p2p-transport.md)."""
    check_stage(item)
    seq = item.seq if seq is None else seq
    return (MAGIC, kind, src, dst, item.layer_idx, item.stage_idx, item.num_stages, seq, tokens)


def check_stage(item: WorkItem) -> None:
    """Raise ValueError unless ``item``'s stage index is below its stage count (the owner's bug, caught before
    the item reaches a peer)."""
    if not 0 <= item.stage_idx < item.num_stages:
        raise ValueError(f"work item {item} claims {item.stage_name}: the stage index must be in 0..num_stages-1")


#: host_bytes' views by (address, bytes): a view names memory, not a tensor, so any tensor there may use it
_HOST_VIEWS: dict[tuple[int, int], memoryview] = {}
_KEPT_HOST_VIEWS = 1024


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no copy; the caller keeps the tensor alive).

    Made once per (address, size) and handed out again (ctypes takes about 2 us a view warm, 30 with cold caches;
    a look-up a fraction of that): the same memoryview object may reach several callers, none of which may
    ``release`` it.
    """
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError(f"expected a contiguous CPU tensor, not {tensor.device} strides {tensor.stride()}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    key = (tensor.data_ptr(), nbytes)
    view = _HOST_VIEWS.get(key)
    if view is None:
        if len(_HOST_VIEWS) >= _KEPT_HOST_VIEWS:
            _HOST_VIEWS.clear()
        view = _HOST_VIEWS[key] = memoryview((ctypes.c_ubyte * nbytes).from_address(key[0])).cast("B")
    return view


def header_view(buffer: torch.Tensor) -> torch.Tensor:
    """The int64 header at the front of a uint8 message buffer."""
    return buffer[:HEADER_BYTES].view(torch.int64)


def validate_header(
    got: Header,
    expected: Header,
    *,
    peer_name: str,
    what: str,
    max_tokens: int | None = None,
    me: str = "the receiver",
) -> None:
    """Raise :class:`ProtocolError` unless ``got`` matches ``expected`` field by field.

    With ``max_tokens`` the token count is only range-checked (``0..max_tokens``),
    for receivers that learn the count from the header.  ``me`` names the
    receiving rank in a stage identity mismatch (which names both sides).
    """
    for field, value, want in zip(FIELDS, got.words, expected.words, strict=True):
        if field in STAGE_FIELDS and got.magic == expected.magic and value != want:
            detail = (
                f"stage identity mismatch: {peer_name} sent {got.names()}, but {me} expects {expected.names()}; "
                "both sides must split the step into the same stages and issue them in the same order"
            )
            raise _bad(expected.src, field, detail, peer_name, what)
        if field == "tokens" and max_tokens is not None:
            if not 0 <= value <= max_tokens:
                raise _bad(
                    expected.src,
                    field,
                    f"expected 0..{max_tokens} (the per-stage capacity), got {value}",
                    peer_name,
                    what,
                )
            continue
        if value != want:
            hint = (
                f" (not a torch_p2p v{VERSION} header: protocol mismatch or corrupted stream)"
                if field == "magic"
                else ""
            )
            detail = f"expected {_show(field, want)}, got {_show(field, value)}{hint}"
            raise _bad(expected.src, field, detail, peer_name, what)


def check_words(
    got: tuple[int, ...],
    expected: tuple[int, ...],
    *,
    what: str,
    describe: Callable[[int], str],
    max_tokens: int | None = None,
) -> None:
    """:func:`validate_header` of two headers' :attr:`Header.words`, the peer being ``expected``'s src and the
    receiver its dst (each named by ``describe(global rank)``, only for an error): one tuple compare when they
    match, else :func:`validate_header` itself (``max_tokens``: the token count, the last word, range-checked)."""
    if max_tokens is None:
        if got == expected:
            return
    elif got[:-1] == expected[:-1] and 0 <= got[-1] <= max_tokens:
        return
    validate_header(
        Header.from_words(got),
        Header.from_words(expected),
        peer_name=describe(expected[2]),
        what=what,
        max_tokens=max_tokens,
        me=describe(expected[3]),
    )


def _show(field: str, value: int) -> str:
    if field == "magic":
        return hex(value)
    if field == "kind":
        return KIND_NAMES.get(value, str(value))
    return str(value)


def _bad(peer: int, field: str, detail: str, peer_name: str, what: str) -> ProtocolError:
    return ProtocolError(
        f"malformed {what} header from {peer_name}: field {field!r} {detail}",
        peer=peer,
        peer_name=peer_name,
        field=field,
    )


@dataclass(frozen=True)
class DispatchLayout:
    """Byte layout of one dispatch payload of ``n`` rows, in blocks: hidden, [scales,] weights, ids.

    Float layout (``quant`` None): hidden fp32 [n, H] | weights fp32 [n, k] | ids int32 [n, k].
    ``quant = "w8a8"``: hidden int8 [n, H] (padded to a multiple of 4 bytes) |
    scales fp32 [n] | weights | ids: a quarter of the hidden bytes plus 4 per row.

    One contiguous message per (item, peer) instead of several keeps gloo's
    per-message cost (tens of microseconds) out of the hot path.
    """

    hidden_size: int
    top_k: int
    quant: str | None = None

    @property
    def kind(self) -> int:
        """The header kind of a dispatch in this layout."""
        return KIND_DISPATCH if self.quant is None else KIND_DISPATCH_W8A8

    @property
    def redispatch_kind(self) -> int:
        """The header kind of a re-send (failover) in this layout."""
        return KIND_REDISPATCH if self.quant is None else KIND_REDISPATCH_W8A8

    @property
    def hidden_dtype(self) -> torch.dtype:
        return torch.float32 if self.quant is None else torch.int8

    def _hidden_bytes(self, tokens: int) -> int:
        raw = tokens * self.hidden_size * (4 if self.quant is None else 1)
        return -(-raw // 4) * 4  # the fp32 blocks after it start 4-byte aligned

    def _scale_bytes(self, tokens: int) -> int:
        return 0 if self.quant is None else tokens * 4

    @property
    def row_bytes(self) -> int:
        """Bytes of a one-row payload."""
        return self.nbytes(1)

    def nbytes(self, tokens: int) -> int:
        return self._hidden_bytes(tokens) + self._scale_bytes(tokens) + tokens * self.top_k * 8

    def views(self, buffer: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [n, H] fp32 or int8, weights [n, k] fp32, ids [n, k] int32) viewing ``buffer``."""
        h, k = self.hidden_size, self.top_k
        a = self._hidden_bytes(tokens)
        b = a + self._scale_bytes(tokens)
        c = b + tokens * k * 4
        hidden = buffer[: tokens * h * self.hidden_dtype.itemsize].view(self.hidden_dtype).view(tokens, h)
        weights = buffer[b:c].view(torch.float32).view(tokens, k)
        ids = buffer[c : self.nbytes(tokens)].view(torch.int32).view(tokens, k)
        return hidden, weights, ids

    def scales(self, buffer: torch.Tensor, tokens: int) -> torch.Tensor:
        """The per-row float32 scales [n] of a quantized payload viewing ``buffer``."""
        if self.quant is None:
            raise ValueError("a float dispatch layout has no scales")
        a = self._hidden_bytes(tokens)
        return buffer[a : a + self._scale_bytes(tokens)].view(torch.float32)


def combine_nbytes(hidden_size: int, tokens: int) -> int:
    """Size of a combine message: header plus ``tokens`` fp32 rows."""
    return HEADER_BYTES + tokens * hidden_size * 4


def combine_rows(buffer: torch.Tensor, hidden_size: int, tokens: int) -> torch.Tensor:
    """The [tokens, H] fp32 rows after the header of a combine message."""
    return buffer[HEADER_BYTES : combine_nbytes(hidden_size, tokens)].view(torch.float32).view(tokens, hidden_size)


def encode_control(buffer: torch.Tensor, header: Header, text: str) -> None:
    header.write(header_view(buffer))
    raw = text.encode("utf-8", "replace")[: CONTROL_TEXT_BYTES - 1]
    body = buffer[HEADER_BYTES:]
    body.zero_()
    if raw:
        body[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def decode_control_text(buffer: torch.Tensor) -> str:
    body = bytes(buffer[HEADER_BYTES:].tolist())
    return body.split(b"\0", 1)[0].decode("utf-8", "replace")
