"""Where a round trip goes: per-point stamp accumulators of the round-trip torch_p2p sides, and their breakdown.

:class:`AttentionStamps` (kept by :class:`~afd_mrv2.hooks.p2p.roundtrip.RoundTripAttentionSide`),
:class:`FfnStamps` (kept by :class:`~afd_mrv2.hooks.p2p.ffn.FfnSide`), :func:`breakdown`.

Each side adds, per item, the ``time.perf_counter_ns()`` stamps of its points to one running sum per
point (a lock, a few integer adds: nothing kept per item).  Every span is the difference of two points,
so the mean of a span over the items is the mean of its end point minus the mean of its start point,
also across the two processes of a pair when both counted the same items and read one clock
(``perf_counter`` is CLOCK_MONOTONIC on Linux: one host).  See docs/internals/p2p-transport.md,
"afd_mrv2.hooks.p2p.stamps: where a round trip goes".
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ATTENTION_POINTS", "FFN_POINTS", "SPANS", "AttentionStamps", "FfnStamps", "breakdown"]

#: the Attention side's points, in the order of a round trip but ``sends_done`` (it overlaps the wire)
ATTENTION_POINTS = ("entered", "packed", "first_send", "sends_done", "combine_done", "waited", "unpacked")
#: the FFN side's points, in order
FFN_POINTS = ("payload_done", "compute_called", "compute_returned", "combine_send")

#: the nine spans of a round trip: (name, side and point it starts at, side and point it ends at);
#: each ends where the next starts, so they add up to ``entered`` -> ``unpacked``
SPANS = (
    ("pack", ("attention", "entered"), ("attention", "packed")),
    ("post", ("attention", "packed"), ("attention", "first_send")),
    ("wire out", ("attention", "first_send"), ("ffn", "payload_done")),
    ("FFN wake-up", ("ffn", "payload_done"), ("ffn", "compute_called")),
    ("FFN compute", ("ffn", "compute_called"), ("ffn", "compute_returned")),
    ("FFN pack", ("ffn", "compute_returned"), ("ffn", "combine_send")),
    ("wire back", ("ffn", "combine_send"), ("attention", "combine_done")),
    ("Attention wake-up", ("attention", "combine_done"), ("attention", "waited")),
    ("unpack", ("attention", "waited"), ("attention", "unpacked")),
)


class _Stamps:
    """Per point, the sum of the stamps (ns) of the items added; thread-safe."""

    points: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items = 0
        self._sums = [0] * len(self.points)

    def as_dict(self) -> dict[str, Any]:
        """``{"items": n, "means_ns": {point: mean stamp}}`` (empty means before the first item).

        Means, not sums: a sum of absolute stamps passes 2**64 after some 10**5 items on a host up for a
        few days, past what msgpack (vLLM's ``collective_rpc``) carries; a mean stays a clock reading.
        Each mean is floored to the nanosecond.
        """
        with self._lock:
            items, sums = self._items, list(self._sums)
        means = {point: total // items for point, total in zip(self.points, sums, strict=True)} if items else {}
        return {"items": items, "means_ns": means}

    def _add(self, *stamps: int) -> None:
        """One item's stamps, in :attr:`points` order."""
        with self._lock:
            self._items += 1
            sums = self._sums
            for i, stamp in enumerate(stamps):
                sums[i] += stamp


class AttentionStamps(_Stamps):
    """The round-trip Attention side's points (:data:`ATTENTION_POINTS`), per item that came back whole."""

    points = ATTENTION_POINTS

    def add(
        self, entered: int, packed: int, first_send: int, sends_done: int, combine_done: int, waited: int, unpacked: int
    ) -> None:
        self._add(entered, packed, first_send, sends_done, combine_done, waited, unpacked)


class FfnStamps(_Stamps):
    """The FFN side's points (:data:`FFN_POINTS`), per item it served (its combine sent)."""

    points = FFN_POINTS

    def add(self, payload_done: int, compute_called: int, compute_returned: int, combine_send: int) -> None:
        self._add(payload_done, compute_called, compute_returned, combine_send)


def breakdown(attention: dict[str, Any], ffn: dict[str, Any] | None, *, one_host: bool = True) -> dict[str, Any]:
    """The mean of each of the nine :data:`SPANS` (us), from the two sides' :meth:`~_Stamps.as_dict`.

    A span of one side is None when that side counted no item (``ffn`` None: no FFN side to read).
    ``wire out`` and ``wire back`` join the two sides: None unless both counted the same items and
    read one clock (``one_host``); ``wire out + back`` (the round trip less the seven other spans)
    needs the same items only.  Also: ``sum`` (the nine, None if one is), ``round trip`` (the
    Attention side's ``entered`` to ``unpacked``) and ``sends`` (``first_send`` to ``sends_done``, beside
    the nine: it overlaps ``wire out`` and may end after the FFN read the payload); ``items``: each side's count.
    """
    means = {"attention": _means(attention), "ffn": _means(ffn)}
    items = {"attention": int(attention["items"]), "ffn": None if ffn is None else int(ffn["items"])}
    joined = bool(means["attention"]) and bool(means["ffn"]) and items["attention"] == items["ffn"]
    out: dict[str, Any] = {}
    for name, (start_side, start), (end_side, end) in SPANS:
        if start_side != end_side and not (joined and one_host):
            out[name] = None
        elif means[start_side] and means[end_side]:
            out[name] = (means[end_side][end] - means[start_side][start]) / 1e3
        else:
            out[name] = None
    spans = [out[name] for name, _, _ in SPANS]
    out["sum"] = None if None in spans else sum(s for s in spans if s is not None)
    a = means["attention"]
    out["round trip"] = (a["unpacked"] - a["entered"]) / 1e3 if a else None
    out["sends"] = (a["sends_done"] - a["first_send"]) / 1e3 if a else None
    inside = [out[name] for name, _, _ in SPANS if name not in ("wire out", "wire back")]
    both = joined and None not in inside and out["round trip"] is not None
    out["wire out + back"] = out["round trip"] - sum(s for s in inside if s is not None) if both else None
    out["items"] = items
    return out


def _means(stamps: dict[str, Any] | None) -> dict[str, int]:
    """A side's mean stamps, empty when it counted no item."""
    if stamps is None or not stamps["items"]:
        return {}
    return {point: int(value) for point, value in stamps["means_ns"].items()}
