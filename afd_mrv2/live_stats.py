"""Live figures of a role process, for ``afd-mrv2 serve``'s ``/metrics`` and ``/afd/status``.

One typed record per role (:class:`AttentionFigures`, :class:`FfnFigures`), a codec
(:func:`encode` / :func:`decode`: a JSON-able dict with a schema version, refusing unknown and
missing fields) and :class:`FiguresPublisher`, which hands a role's record to the rendezvous store
every second on a thread of its own (serve reads them back from there, on any node: docs/serve.md,
"Metrics and status").
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, final

from afd_mrv2.errors import AfdError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.pipeline.metrics import fraction

WRITE_EVERY_S = 1.0
#: Upper bounds (seconds) of the Attention side's round-trip histogram.
ROUND_TRIP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: The version of the documents :func:`encode` writes and :func:`decode` accepts: a change of a record's
#: fields is a new version.
SCHEMA_VERSION = 2
#: The document key that carries :data:`SCHEMA_VERSION`.
SCHEMA_KEY = "schema"
#: The kinds :class:`MemoryFigures` counts bytes by (``afd_mrv2.mrv2.memory``): routed experts, everything else.
MEMORY_KINDS = ("routed_experts", "other")

log = logging.getLogger(__name__)


class FiguresError(AfdError, ValueError):
    """A live-figures document the codec refuses: the message names the document, the key and what is
    accepted."""


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class HistogramFigures:
    """A cumulative histogram, Prometheus' shape."""

    buckets: tuple[float, ...]
    """Upper bounds (seconds), ascending."""
    counts: tuple[int, ...]
    """Observations at or below each bound (cumulative), one per bound."""
    sum: float
    """The sum of every observation (seconds)."""
    count: int
    """Observations in all, those above the last bound included."""

    def as_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}

    @classmethod
    def from_dict(cls, doc: object, where: str) -> HistogramFigures:
        d = _exact(doc, where, cls)
        buckets = tuple(_float(b, f"{where}.buckets") for b in _list(d["buckets"], f"{where}.buckets"))
        counts = tuple(_int(c, f"{where}.counts") for c in _list(d["counts"], f"{where}.counts"))
        if len(counts) != len(buckets):
            raise FiguresError(f"{where}.counts: {len(counts)} counts for {len(buckets)} buckets, accepted: one each")
        return cls(
            buckets=buckets,
            counts=counts,
            sum=_float(d["sum"], f"{where}.sum"),
            count=_int(d["count"], f"{where}.count"),
        )


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class LostRank:
    """One FFN rank an Attention engine stopped routing to."""

    at: float
    """When (``time.time()``, rounded to ms)."""
    reason: str
    """The first line of the error that lost it."""

    def as_dict(self) -> dict[str, Any]:
        return {"at": self.at, "reason": self.reason}

    @classmethod
    def from_dict(cls, doc: object, where: str) -> LostRank:
        d = _exact(doc, where, cls)
        return cls(at=_float(d["at"], f"{where}.at"), reason=_str(d["reason"], f"{where}.reason"))


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class FailoverFigures:
    """What an Attention engine's failovers did (:class:`~afd_mrv2.hooks.p2p.failover.FailoverLog`, whose
    ``as_dict`` is this record's document); times are ``time.time()``, rounded to ms."""

    failovers: int
    """FFN ranks failed over."""
    lost: Mapping[int, LostRank]
    """FFN rank -> when and why this engine stopped routing to it."""
    first_resend_at: Mapping[int, float]
    """FFN rank -> when its first share was re-sent to another holder."""
    resent_items: int
    """Work items of which a lost rank's share was re-sent."""
    resent_rows: int
    """Token rows re-sent, all those items together."""
    rejoins: int
    """Restarted FFN ranks taken back."""
    rejoined_at: Mapping[int, float]
    """FFN rank -> when this engine last took it back."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "failovers": self.failovers,
            "lost": {str(f): lost.as_dict() for f, lost in sorted(self.lost.items())},
            "first_resend_at": _by_rank(self.first_resend_at),
            "resent_items": self.resent_items,
            "resent_rows": self.resent_rows,
            "rejoins": self.rejoins,
            "rejoined_at": _by_rank(self.rejoined_at),
        }

    @classmethod
    def from_dict(cls, doc: object, where: str) -> FailoverFigures:
        d = _exact(doc, where, cls)
        return cls(
            failovers=_int(d["failovers"], f"{where}.failovers"),
            lost={
                rank: LostRank.from_dict(value, f"{where}.lost.{rank}")
                for rank, value in _ranks(d["lost"], f"{where}.lost").items()
            },
            first_resend_at=_times(d["first_resend_at"], f"{where}.first_resend_at"),
            resent_items=_int(d["resent_items"], f"{where}.resent_items"),
            resent_rows=_int(d["resent_rows"], f"{where}.resent_rows"),
            rejoins=_int(d["rejoins"], f"{where}.rejoins"),
            rejoined_at=_times(d["rejoined_at"], f"{where}.rejoined_at"),
        )


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryFigures:
    """What a role process read from its checkpoint and holds (``afd_mrv2.mrv2.memory``), by kind:
    ``routed_experts`` and ``other``."""

    read_bytes: Mapping[str, int]
    """Bytes of the checkpoint tensors its loader read, by kind."""
    resident_bytes: Mapping[str, int]
    """Bytes of its model's parameters after loading, by kind."""
    peak_rss_bytes: int
    """Its peak resident set size (``VmHWM``) when the record was made."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "read_bytes": dict(sorted(self.read_bytes.items())),
            "resident_bytes": dict(sorted(self.resident_bytes.items())),
            "peak_rss_bytes": self.peak_rss_bytes,
        }

    @classmethod
    def from_dict(cls, doc: object, where: str) -> MemoryFigures:
        d = _exact(doc, where, cls)
        return cls(
            read_bytes=_bytes_by_kind(d["read_bytes"], f"{where}.read_bytes"),
            resident_bytes=_bytes_by_kind(d["resident_bytes"], f"{where}.resident_bytes"),
            peak_rss_bytes=_int(d["peak_rss_bytes"], f"{where}.peak_rss_bytes"),
        )


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionFigures:
    """What an Attention engine counted (``RemoteExperts.live_stats``), all since its process started."""

    calls: int
    """MoE layer calls (one per MoE layer per micro-batch per forward)."""
    tokens: int
    """Tokens of those calls, all calls together."""
    round_trip_seconds: HistogramFigures
    """Seconds from dispatch to the combined result, per call (over :data:`ROUND_TRIP_BUCKETS`)."""
    round_trip_total_s: float
    """The round trips' seconds, all together."""
    hidden_total_s: float
    """Of :attr:`round_trip_total_s`, the seconds under another micro-batch's compute."""
    failover: FailoverFigures | None
    """The connector's failover record, None where it keeps none."""
    memory: MemoryFigures | None
    """What the engine read and holds, None where it did not load with the ``afd`` load format."""

    @property
    def hidden_fraction(self) -> float:
        """The share of round-trip time under another micro-batch's compute (0 before any round trip)."""
        return fraction(self.hidden_total_s, self.round_trip_total_s)

    @property
    def failovers(self) -> int:
        return 0 if self.failover is None else self.failover.failovers

    @property
    def resent_items(self) -> int:
        return 0 if self.failover is None else self.failover.resent_items

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "tokens": self.tokens,
            "round_trip_seconds": self.round_trip_seconds.as_dict(),
            "round_trip_total_s": self.round_trip_total_s,
            "hidden_total_s": self.hidden_total_s,
            "failover": None if self.failover is None else self.failover.as_dict(),
            "memory": _memory_doc(self.memory),
        }

    @classmethod
    def from_dict(cls, doc: object, where: str) -> AttentionFigures:
        d = _exact(doc, where, cls)
        failover = d["failover"]
        return cls(
            calls=_int(d["calls"], f"{where}.calls"),
            tokens=_int(d["tokens"], f"{where}.tokens"),
            round_trip_seconds=HistogramFigures.from_dict(d["round_trip_seconds"], f"{where}.round_trip_seconds"),
            round_trip_total_s=_float(d["round_trip_total_s"], f"{where}.round_trip_total_s"),
            hidden_total_s=_float(d["hidden_total_s"], f"{where}.hidden_total_s"),
            failover=None if failover is None else FailoverFigures.from_dict(failover, f"{where}.failover"),
            memory=_memory(d["memory"], f"{where}.memory"),
        )


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class FfnFigures:
    """What an FFN rank counted (``FfnReport.figures``), all since its process started."""

    items: int
    """Work items whose headers arrived, all Attention engines and stage counts together."""
    computed: int
    """Of those, the items with at least one token here (expert computations)."""
    tokens: int
    """Tokens the experts were computed for, all computations together."""
    busy_s: float
    """Seconds spent computing experts."""
    redispatched: int
    """Shares re-sent here after an Attention engine lost another FFN rank holding the same experts."""
    up_s: float
    """Seconds since the rank started serving."""
    memory: MemoryFigures | None
    """What the rank read and holds, None where it did not load with the ``afd`` load format."""
    ranks_per_call: Mapping[int, int] = field(default_factory=dict)
    """Expert computations by how many Attention ranks contributed rows to each (M:N: an Attention group's
    ranks meet in one computation; a rank that sent 0 rows does not count)."""

    @property
    def busy_fraction(self) -> float:
        """The share of :attr:`up_s` spent computing experts (0 before the rank served)."""
        return fraction(self.busy_s, self.up_s)

    @property
    def tokens_per_call(self) -> float:
        """Tokens per expert computation (0 before the first)."""
        return fraction(self.tokens, self.computed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "computed": self.computed,
            "tokens": self.tokens,
            "busy_s": self.busy_s,
            "redispatched": self.redispatched,
            "up_s": self.up_s,
            "memory": _memory_doc(self.memory),
            "ranks_per_call": {str(n): c for n, c in sorted(self.ranks_per_call.items())},
        }

    @classmethod
    def from_dict(cls, doc: object, where: str) -> FfnFigures:
        d = _exact(doc, where, cls)
        return cls(
            items=_int(d["items"], f"{where}.items"),
            computed=_int(d["computed"], f"{where}.computed"),
            tokens=_int(d["tokens"], f"{where}.tokens"),
            busy_s=_float(d["busy_s"], f"{where}.busy_s"),
            redispatched=_int(d["redispatched"], f"{where}.redispatched"),
            up_s=_float(d["up_s"], f"{where}.up_s"),
            memory=_memory(d["memory"], f"{where}.memory"),
            ranks_per_call=_counts(d["ranks_per_call"], f"{where}.ranks_per_call"),
        )


#: A role's record.
Figures = AttentionFigures | FfnFigures
#: The record of each role: what :func:`decode` builds from a document of that role.
RECORDS: dict[str, type[AttentionFigures] | type[FfnFigures]] = {ATTENTION: AttentionFigures, FFN: FfnFigures}


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class Written:
    """A role's figures as a reader gets them: the record, and which process wrote it when."""

    figures: Figures
    """The role's record."""
    at: float
    """When it was written (``time.time()``, rounded to ms)."""
    pid: int
    """The writing process: a restarted role's figures, which start from 0 again, are told apart."""

    def as_dict(self) -> dict[str, Any]:
        """The record's fields with ``at`` and ``pid``, keys sorted at every level (``/afd/status`` shows it)."""
        return _sorted({**self.figures.as_dict(), "at": self.at, "pid": self.pid})


def encode(written: Written) -> dict[str, Any]:
    """``written`` as a JSON-able document: :meth:`Written.as_dict` and :data:`SCHEMA_KEY`."""
    return {SCHEMA_KEY: SCHEMA_VERSION, **written.as_dict()}


def decode(role: str, doc: object, *, where: str = "live figures") -> Written:
    """The :class:`Written` a role's document holds; :class:`FiguresError` (naming ``where`` and the key)
    for a role without a record, another schema version, or a key missing, unknown or of the wrong type."""
    record = RECORDS.get(role)
    if record is None:
        raise FiguresError(f"{where}: no live figures for role {role!r}; accepted: {sorted(RECORDS)}")
    if not isinstance(doc, Mapping):
        raise FiguresError(f"{where}: expected an object, got {type(doc).__name__}")
    version = doc.get(SCHEMA_KEY)
    if version != SCHEMA_VERSION:
        raise FiguresError(f"{where}.{SCHEMA_KEY}: {version!r}, accepted: {SCHEMA_VERSION} (another afd-mrv2?)")
    envelope = ("at", "pid")
    missing = [k for k in envelope if k not in doc]
    if missing:
        raise FiguresError(f"{where}: missing {missing} (the writer's stamp)")
    return Written(
        figures=record.from_dict({k: v for k, v in doc.items() if k not in (*envelope, SCHEMA_KEY)}, where),
        at=_float(doc["at"], f"{where}.at"),
        pid=_int(doc["pid"], f"{where}.pid"),
    )


# -- the publisher ------------------------------------------------------------------------------------

#: What a role hands :class:`FiguresPublisher`: a function building its record now.  A dict (the record's
#: document without ``schema``, ``at``, ``pid``; without ``memory``: None) is converted, with a
#: DeprecationWarning, for one more version.
Build = Callable[[], Figures | dict[str, Any]]
#: Where a role's figures go: the rendezvous store's ``publish_live`` for that role, bound by the role.
Publish = Callable[[Written], None]


class FiguresPublisher:
    """Builds a ``role``'s figures with ``build`` and hands them to ``publish`` every ``every_s``, on a daemon
    thread of its own: never on the caller's thread (a store behind a cut link blocks only that thread), and
    whether or not the role serves (current within ``every_s`` after a burst).  :meth:`nudge` publishes at
    once (a failover); :meth:`stop` publishes a last time.  A publish that raises is dropped: figures are best
    effort, and the next period tries again.
    """

    def __init__(self, role: str, publish: Publish, build: Build, every_s: float = WRITE_EVERY_S) -> None:
        if role not in RECORDS:
            raise FiguresError(f"no live figures for role {role!r}; accepted: {sorted(RECORDS)}")
        self.role = role
        self.publish = publish
        self.build = build
        self.every_s = every_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        #: how many publishes went through
        self.published = 0

    def start(self) -> None:
        """Start the publishing thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="afd-live-stats", daemon=True)
            self._thread.start()

    def nudge(self) -> None:
        """Publish now rather than at the end of the period."""
        self._wake.set()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Publish a last time and end the thread (waiting up to ``timeout_s`` for that publish)."""
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        self._wake.set()
        thread.join(timeout_s)

    def publish_now(self) -> None:
        """Build and publish on this thread (what the publishing thread does each period)."""
        written = Written(figures=self._figures(), at=round(time.time(), 3), pid=os.getpid())
        try:
            self.publish(written)
        except Exception as exc:  # noqa: BLE001 - best effort: the store may be gone or cut off
            log.debug("live figures of %s not published: %s", self.role, exc)
        else:
            self.published += 1

    def _run(self) -> None:
        while True:
            self._wake.wait(self.every_s)
            self._wake.clear()
            self.publish_now()
            if self._stopping.is_set():
                return

    def _figures(self) -> Figures:
        built = self.build()
        if not isinstance(built, dict):
            return built
        if not self._warned:
            self._warned = True
            warnings.warn(
                "a live-figures builder returning a dict is deprecated: return an AttentionFigures or FfnFigures",
                DeprecationWarning,
                stacklevel=3,
            )
        return RECORDS[self.role].from_dict({"memory": None, **built}, self.role)  # a schema-1 builder has no memory


class Histogram:
    """A cumulative histogram over :data:`ROUND_TRIP_BUCKETS` (Prometheus' shape); thread-safe."""

    def __init__(self, buckets: tuple[float, ...] = ROUND_TRIP_BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * len(buckets)
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            index = bisect.bisect_left(self.buckets, seconds)
            if index < len(self._counts):
                self._counts[index] += 1
            self._sum += seconds
            self._count += 1

    def figures(self) -> HistogramFigures:
        with self._lock:
            cumulative, total = [], 0
            for n in self._counts:
                total += n
                cumulative.append(total)
            return HistogramFigures(buckets=self.buckets, counts=tuple(cumulative), sum=self._sum, count=self._count)


# -- the codec's checks ------------------------------------------------------------------------------


def _exact(doc: object, where: str, record: type) -> Mapping[str, Any]:
    """``doc`` as a mapping with exactly ``record``'s fields, else :class:`FiguresError`."""
    if not isinstance(doc, Mapping):
        raise FiguresError(f"{where}: expected an object, got {type(doc).__name__}")
    names = [f.name for f in fields(record)]
    missing = [n for n in names if n not in doc]
    unknown = sorted(str(k) for k in doc if k not in names)
    if missing or unknown:
        said = [f"missing {missing}" if missing else "", f"unknown {unknown}" if unknown else ""]
        raise FiguresError(f"{where}: {', '.join(s for s in said if s)}; accepted: {sorted(names)}")
    return doc


def _counts(value: object, where: str) -> dict[int, int]:
    """``{"1": n1, "2": n2, ...}`` as ``{1: n1, 2: n2, ...}``, else :class:`FiguresError`."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k.isdigit() for k in value):
        raise FiguresError(f"{where}: expected an object of counts keyed by integers, got {value!r}")
    return {int(k): _int(v, f"{where}.{k}") for k, v in value.items()}


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FiguresError(f"{where}: expected an integer, got {value!r}")
    return value


def _float(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FiguresError(f"{where}: expected a number, got {value!r}")
    return value  # an int stays one: its document is the same again


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise FiguresError(f"{where}: expected a string, got {value!r}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise FiguresError(f"{where}: expected a list, got {value!r}")
    return list(value)


def _ranks(value: object, where: str) -> dict[int, Any]:
    """A document's ``{"<rank>": ...}`` as ``{rank: ...}``."""
    if not isinstance(value, Mapping):
        raise FiguresError(f"{where}: expected an object, got {type(value).__name__}")
    out: dict[int, Any] = {}
    for key, item in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise FiguresError(f"{where}: key {key!r} is not an FFN rank")
        out[int(key)] = item
    return out


def _times(value: object, where: str) -> dict[int, float]:
    return {rank: _float(t, f"{where}.{rank}") for rank, t in _ranks(value, where).items()}


def _bytes_by_kind(value: object, where: str) -> dict[str, int]:
    """A document's ``{kind: bytes}``, with exactly the :data:`MEMORY_KINDS`."""
    if not isinstance(value, Mapping):
        raise FiguresError(f"{where}: expected an object of kind -> bytes, got {type(value).__name__}")
    if set(value) != set(MEMORY_KINDS):
        raise FiguresError(f"{where}: kinds {sorted(map(str, value))}, accepted: {sorted(MEMORY_KINDS)}")
    return {kind: _int(value[kind], f"{where}.{kind}") for kind in MEMORY_KINDS}


def _memory(value: object, where: str) -> MemoryFigures | None:
    return None if value is None else MemoryFigures.from_dict(value, where)


def _memory_doc(memory: MemoryFigures | None) -> dict[str, Any] | None:
    return None if memory is None else memory.as_dict()


def _by_rank(times: Mapping[int, float]) -> dict[str, float]:
    return {str(f): t for f, t in sorted(times.items())}


def _sorted(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with the keys of every mapping in it sorted (as ``json.dumps(sort_keys=True)`` writes them;
    the records' lists hold numbers only)."""
    return {k: _sorted(v) if isinstance(v, Mapping) else v for k, v in sorted(doc.items())}
