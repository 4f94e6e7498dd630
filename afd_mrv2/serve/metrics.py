"""``GET /metrics`` and ``GET /afd/status`` on serve's endpoint (:data:`AFD_METRICS`, docs/serve.md).

See docs/internals/serve.md, "afd_mrv2.serve.metrics".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.live_stats import AttentionFigures, FfnFigures, Written

#: The ``Content-Type`` of ``/metrics`` (Prometheus text format).
CONTENT_TYPE = CONTENT_TYPE_LATEST
#: How long ``/metrics`` waits for one engine's ``/metrics``.
SCRAPE_TIMEOUT_S = 5.0

#: The AFD metrics serve itself exports: name -> (type, help).  Their names fall under the
#: CHANGELOG's rule (a rename keeps the old name for one more hook API version).
AFD_METRICS: dict[str, tuple[str, str]] = {
    "afd_attention_ranks": ("gauge", "Attention engines in the topology (A)."),
    "afd_ffn_ranks": ("gauge", "FFN ranks in the topology (F)."),
    "afd_attention_ranks_live": ("gauge", "Attention engines ready and alive."),
    "afd_ffn_ranks_live": ("gauge", "FFN ranks ready and alive."),
    "afd_role_live": ("gauge", "1 when the role (role, rank) is ready and its process group alive, else 0."),
    "afd_ready": ("gauge", "1 once every role is ready and until serve stops, else 0."),
    "afd_endpoint_requests": (
        "counter",
        "Requests the endpoint finished relaying to each Attention engine (any status).",
    ),
    "afd_endpoint_requests_in_flight": ("gauge", "Requests the endpoint is relaying to each Attention engine now."),
    "afd_engine_scrape_ok": ("gauge", "1 when the engine's own /metrics answered this scrape, else 0."),
    "afd_ffn_failovers": (
        "counter",
        "FFN ranks lost while every expert kept a live holder (--expert-replicas >= 2): serve served on.",
    ),
    "afd_expert_replicas": ("gauge", "FFN ranks each routed expert lives on (R)."),
    "afd_role_restarts": ("counter", "Restarts of each role rank that got ready (a lost FFN rank or engine)."),
    "afd_role_restarts_exhausted": (
        "gauge",
        "1 for a lost role rank serve will not restart again (its restarts are used up): serve runs degraded.",
    ),
    "afd_degraded": ("gauge", "1 while a role rank is lost (failed over or out of rotation) and not back, else 0."),
    "afd_ffn_items": ("counter", "Work items (MoE layer calls of an engine, re-sends included) each FFN rank served."),
    "afd_ffn_tokens": ("counter", "Tokens each FFN rank computed its experts for (the A/F skew, per rank)."),
    "afd_ffn_expert_calls": ("counter", "Expert computations of each FFN rank (one per MoE layer call it computed)."),
    "afd_ffn_ranks_per_call": (
        "counter",
        "Expert computations of each FFN rank by how many Attention ranks contributed rows to each (M:N).",
    ),
    "afd_ffn_tokens_per_call": ("gauge", "Tokens per expert computation of each FFN rank, since it started."),
    "afd_ffn_redispatched": ("counter", "Re-sent shares each FFN rank served after an Attention engine's failover."),
    "afd_ffn_busy_fraction": ("gauge", "Share of each FFN rank's serving time spent computing experts."),
    "afd_attention_failovers": ("counter", "FFN ranks each Attention engine stopped routing to and failed over."),
    "afd_attention_resent_items": ("counter", "Work items of which each Attention engine re-sent a lost rank's share."),
    "afd_attention_round_trip_seconds": (
        "histogram",
        "Seconds from dispatch to the combined result of each MoE call, per Attention engine.",
    ),
    "afd_attention_hidden_fraction": (
        "gauge",
        "Share of each Attention engine's round-trip time that ran under another micro-batch's compute.",
    ),
    "afd_role_read_bytes": (
        "gauge",
        "Bytes of checkpoint tensors each role rank read at load, by kind (routed_experts, other).",
    ),
    "afd_role_resident_bytes": ("gauge", "Bytes of each role rank's model parameters after load, by kind."),
    "afd_role_peak_rss_bytes": ("gauge", "Peak resident set size of each role rank's worker process (VmHWM)."),
}


@dataclass(frozen=True)
class RoleState:
    """One role process as ``/metrics`` and ``/afd/status`` report it."""

    role: str
    rank: int
    pid: int
    live: bool


@dataclass(frozen=True)
class Health:
    """What the supervisor knows beyond the role processes: failovers, the placement, and each role's live
    figures (:meth:`afd_mrv2.serve.figures.FiguresReader.figures`: ``{(role, rank): written}``)."""

    failovers: int = 0
    replicas: int = 1
    placement: tuple[str, ...] = ()
    figures: Mapping[tuple[str, int], Written] = field(default_factory=dict)
    #: restarts that got ready, by ``"<role> <rank>"``
    restarts: Mapping[str, int] = field(default_factory=dict)
    #: lost role ranks serve will not restart again, as ``"<role> <rank>"``
    exhausted: tuple[str, ...] = ()
    #: role ranks lost and not back, as ``"<role> <rank>"``
    lost: tuple[str, ...] = ()
    #: over several nodes: each other node's ``live``, ``joining`` or ``lost: why``, by node rank
    nodes: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCount:
    """The endpoint's own counts for one Attention engine."""

    rank: int
    requests: int
    in_flight: int


def relabel(text: str, first: int) -> list[Metric]:
    """The metric families of one backend's ``/metrics`` text (an independent engine's, or a data-parallel
    group's, whose vLLM labels each DP rank's samples ``engine="i"``), each sample labelled
    ``engine=<first + i>`` (``first`` for a sample without the label)."""
    families = []
    for family in text_string_to_metric_families(text):
        samples = [s._replace(labels={**s.labels, "engine": _engine(s.labels, first)}) for s in family.samples]
        family.samples = samples
        families.append(family)
    return families


def _engine(labels: Mapping[str, str], first: int) -> str:
    own = labels.get("engine", "0")
    return str(first + int(own)) if own.isdigit() else str(first)


def merge(families: Iterable[Metric]) -> list[Metric]:
    """Families of the same name (one per engine) as one family, samples in engine order: the text
    format allows each family's ``# HELP`` / ``# TYPE`` once."""
    merged: dict[str, Metric] = {}
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        into.samples.extend(family.samples)
    return list(merged.values())


def afd_families(
    attention: int,
    ffn: int,
    roles: Sequence[RoleState],
    engines: Sequence[EngineCount],
    scraped: Mapping[int, bool],
    ready: bool,
    health: Health | None = None,
) -> list[Metric]:
    """serve's own metrics (:data:`AFD_METRICS`) from what the supervisor and the endpoint know now."""

    def gauge(name: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, AFD_METRICS[name][1], value=value)

    out: list[Metric] = [
        gauge("afd_attention_ranks", attention),
        gauge("afd_ffn_ranks", ffn),
        gauge("afd_attention_ranks_live", len(_ranks(roles, ATTENTION, live=True))),
        gauge("afd_ffn_ranks_live", len(_ranks(roles, FFN, live=True))),
        gauge("afd_ready", 1 if ready else 0),
    ]
    live = GaugeMetricFamily("afd_role_live", AFD_METRICS["afd_role_live"][1], labels=["role", "rank"])
    for r in roles:
        live.add_metric([r.role, str(r.rank)], 1 if r.live else 0)
    requests = CounterMetricFamily("afd_endpoint_requests", AFD_METRICS["afd_endpoint_requests"][1], labels=["engine"])
    in_flight = GaugeMetricFamily(
        "afd_endpoint_requests_in_flight", AFD_METRICS["afd_endpoint_requests_in_flight"][1], labels=["engine"]
    )
    for e in engines:
        requests.add_metric([str(e.rank)], e.requests)
        in_flight.add_metric([str(e.rank)], e.in_flight)
    scrape = GaugeMetricFamily("afd_engine_scrape_ok", AFD_METRICS["afd_engine_scrape_ok"][1], labels=["engine"])
    for rank in sorted(scraped):
        scrape.add_metric([str(rank)], 1 if scraped[rank] else 0)
    return [*out, live, requests, in_flight, scrape, *_health_families(health or Health())]


def _health_families(health: Health) -> list[Metric]:
    """The failover and live-figure metrics: one sample per role that wrote figures."""

    def labelled(kind: Any, name: str, label: str) -> Any:
        return kind(name, AFD_METRICS[name][1], labels=[label])

    failovers = CounterMetricFamily("afd_ffn_failovers", AFD_METRICS["afd_ffn_failovers"][1], value=health.failovers)
    replicas = GaugeMetricFamily("afd_expert_replicas", AFD_METRICS["afd_expert_replicas"][1], value=health.replicas)
    restarts = CounterMetricFamily("afd_role_restarts", AFD_METRICS["afd_role_restarts"][1], labels=["role", "rank"])
    for name, n in sorted(health.restarts.items()):
        restarts.add_metric(name.split(" ", 1), n)
    exhausted = GaugeMetricFamily(
        "afd_role_restarts_exhausted", AFD_METRICS["afd_role_restarts_exhausted"][1], labels=["role", "rank"]
    )
    for name in health.exhausted:
        exhausted.add_metric(name.split(" ", 1), 1.0)
    degraded = GaugeMetricFamily("afd_degraded", AFD_METRICS["afd_degraded"][1], value=1.0 if health.lost else 0.0)
    items = labelled(CounterMetricFamily, "afd_ffn_items", "ffn")
    tokens = labelled(CounterMetricFamily, "afd_ffn_tokens", "ffn")
    calls = labelled(CounterMetricFamily, "afd_ffn_expert_calls", "ffn")
    per_call = CounterMetricFamily(
        "afd_ffn_ranks_per_call", AFD_METRICS["afd_ffn_ranks_per_call"][1], labels=["ffn", "ranks"]
    )
    tokens_per_call = labelled(GaugeMetricFamily, "afd_ffn_tokens_per_call", "ffn")
    redispatched = labelled(CounterMetricFamily, "afd_ffn_redispatched", "ffn")
    busy = labelled(GaugeMetricFamily, "afd_ffn_busy_fraction", "ffn")
    att_failovers = labelled(CounterMetricFamily, "afd_attention_failovers", "engine")
    resent = labelled(CounterMetricFamily, "afd_attention_resent_items", "engine")
    hidden = labelled(GaugeMetricFamily, "afd_attention_hidden_fraction", "engine")
    round_trip = labelled(HistogramMetricFamily, "afd_attention_round_trip_seconds", "engine")
    for (_, rank), written in sorted(health.figures.items()):
        label = [str(rank)]
        match written.figures:
            case FfnFigures() as ffn:
                items.add_metric(label, float(ffn.items))
                tokens.add_metric(label, float(ffn.tokens))
                calls.add_metric(label, float(ffn.computed))
                tokens_per_call.add_metric(label, ffn.tokens_per_call)
                for ranks, n in sorted(ffn.ranks_per_call.items()):
                    per_call.add_metric([str(rank), str(ranks)], float(n))
                redispatched.add_metric(label, float(ffn.redispatched))
                busy.add_metric(label, ffn.busy_fraction)
            case AttentionFigures() as engine:
                att_failovers.add_metric(label, float(engine.failovers))
                resent.add_metric(label, float(engine.resent_items))
                hidden.add_metric(label, engine.hidden_fraction)
                hist = engine.round_trip_seconds
                buckets = [(repr(float(b)), float(c)) for b, c in zip(hist.buckets, hist.counts, strict=True)]
                buckets.append(("+Inf", float(hist.count)))
                round_trip.add_metric(label, buckets, float(hist.sum))
    counts = [failovers, replicas, restarts, exhausted, degraded, items, tokens, calls, per_call, tokens_per_call]
    counts += [redispatched, busy]
    counts += [att_failovers, resent, hidden]
    return [*counts, round_trip, *_memory_families(health.figures)]


def _memory_families(figures: Mapping[tuple[str, int], Written]) -> list[Metric]:
    """What each role rank read and holds, by kind, and its peak RSS: one sample set per role rank whose
    record has memory figures (a role that did not load with the ``afd`` load format has none)."""

    def family(name: str, labels: list[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, AFD_METRICS[name][1], labels=labels)

    read = family("afd_role_read_bytes", ["role", "rank", "kind"])
    resident = family("afd_role_resident_bytes", ["role", "rank", "kind"])
    peak = family("afd_role_peak_rss_bytes", ["role", "rank"])
    for (role, rank), written in sorted(figures.items()):
        memory = written.figures.memory
        if memory is None:
            continue
        for kind, n in sorted(memory.read_bytes.items()):
            read.add_metric([role, str(rank), kind], float(n))
        for kind, n in sorted(memory.resident_bytes.items()):
            resident.add_metric([role, str(rank), kind], float(n))
        peak.add_metric([role, str(rank)], float(memory.peak_rss_bytes))
    return [read, resident, peak]


def _ranks(roles: Sequence[RoleState], role: str, *, live: bool) -> list[int]:
    """The ranks of ``role`` that are live (or lost)."""
    return [r.rank for r in roles if r.role == role and r.live == live]


class _Families:
    """A one-shot collector: ``prometheus_client`` renders what it yields."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def render(families: list[Metric]) -> bytes:
    """The Prometheus text exposition of ``families`` (``prometheus_client.generate_latest``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def status(
    attention: int,
    ffn: int,
    roles: Sequence[RoleState],
    engines: Sequence[EngineCount],
    ready: bool,
    down: str | None,
    health: Health | None = None,
) -> dict[str, Any]:
    """The ``/afd/status`` document."""
    health = health or Health()
    return {
        "topology": {"attention": attention, "ffn": ffn, "expert_replicas": health.replicas},
        "placement": list(health.placement),
        "failovers": health.failovers,
        "restarts": dict(health.restarts),
        "restarts_exhausted": list(health.exhausted),
        "degraded": list(health.lost),
        "nodes": dict(health.nodes),
        "figures": {f"{role} {rank}": written.as_dict() for (role, rank), written in sorted(health.figures.items())},
        "ready": ready,
        "down": down,
        "roles": [{"role": r.role, "rank": r.rank, "pid": r.pid, "live": r.live} for r in roles],
        "live": {role: _ranks(roles, role, live=True) for role in (ATTENTION, FFN)},
        "lost": {role: _ranks(roles, role, live=False) for role in (ATTENTION, FFN)},
        "requests": {str(e.rank): {"finished": e.requests, "in_flight": e.in_flight} for e in engines},
    }


#: What the supervisor hands the endpoint: the role states now, and the rest of what it knows.
RoleStates = Callable[[], Sequence[RoleState]]
HealthNow = Callable[[], Health]
