"""``GET /metrics`` and ``GET /afd/status`` on serve's endpoint: the engines' own metrics relabelled by
Attention rank, serve's AFD metrics, and the status document (fake roles, no vLLM)."""

from __future__ import annotations

import json
import signal
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from afd_mrv2.serve import metrics

ENGINE_TEXT = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:request_success_total Finished requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",model_name="m"} 5.0
# HELP process_open_fds Open fds.
# TYPE process_open_fds gauge
process_open_fds 7.0
"""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition: (name, sorted labels) -> value (parsed, so valid)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_engines_are_relabelled_by_attention_rank_and_each_family_is_declared_once() -> None:
    families = metrics.merge([*metrics.relabel(ENGINE_TEXT, 0), *metrics.relabel(ENGINE_TEXT.replace("5.0", "9.0"), 1)])
    text = metrics.render(families).decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert text.count("# HELP vllm:request_success_total") == 1
    got = samples(text)
    assert got[("vllm:request_success_total", (("engine", "0"), ("model_name", "m")))] == 5.0
    assert got[("vllm:request_success_total", (("engine", "1"), ("model_name", "m")))] == 9.0
    # a sample without an engine label gets one: the two servers' series stay apart
    assert got[("process_open_fds", (("engine", "0"),))] == 7.0 and got[("process_open_fds", (("engine", "1"),))] == 7.0


def test_afd_metrics_count_live_roles_and_endpoint_requests() -> None:
    roles = [
        metrics.RoleState("ffn", 0, 10, True),
        metrics.RoleState("ffn", 1, 11, False),
        metrics.RoleState("attention", 0, 12, True),
    ]
    engines = [metrics.EngineCount(0, 4, 1)]
    text = metrics.render(metrics.afd_families(1, 2, roles, engines, {0: True}, ready=True)).decode()
    got = samples(text)
    assert got[("afd_ffn_ranks", ())] == 2 and got[("afd_ffn_ranks_live", ())] == 1
    assert got[("afd_role_live", (("rank", "1"), ("role", "ffn")))] == 0
    assert got[("afd_endpoint_requests_total", (("engine", "0"),))] == 4
    assert got[("afd_endpoint_requests_in_flight", (("engine", "0"),))] == 1
    assert got[("afd_engine_scrape_ok", (("engine", "0"),))] == 1 and got[("afd_ready", ())] == 1
    names = {f.name for f in text_string_to_metric_families(text)}
    assert names == {n.removesuffix("_total") for n in metrics.AFD_METRICS}  # every documented metric, no other
    doc = metrics.status(1, 2, roles, engines, True, None)
    assert doc["live"] == {"attention": [0], "ffn": [0]} and doc["lost"] == {"attention": [], "ffn": [1]}


def test_live_figures_of_the_roles_become_per_rank_metrics() -> None:
    """What each role process publishes (its typed record, through the rendezvous store) is read back and
    shown per rank: the FFN ranks' items, tokens, re-sends and busy fraction; the engines' failovers,
    round-trip histogram and hidden fraction; each role rank's memory figures where it has them.
    ``/afd/status`` shows each record as the role published it, less its schema."""
    from afd_mrv2.live_stats import (
        SCHEMA_KEY,
        SCHEMA_VERSION,
        AttentionFigures,
        FailoverFigures,
        FfnFigures,
        Histogram,
        MemoryFigures,
    )
    from tests.serve.figures_support import new_store, publish, raw_set, read_back

    hist = Histogram()
    for seconds in (0.002, 0.004, 0.3):
        hist.observe(seconds)
    failover = FailoverFigures(
        failovers=1,
        lost={},
        first_resend_at={1: 12.5},
        resent_items=3,
        resent_rows=7,
        rejoins=0,
        rejoined_at={},
    )
    attention = AttentionFigures(
        calls=4,
        tokens=32,
        round_trip_seconds=hist.figures(),
        round_trip_total_s=2.0,
        hidden_total_s=0.5,
        failover=failover,
        memory=MemoryFigures(
            read_bytes={"routed_experts": 0, "other": 5_000},
            resident_bytes={"routed_experts": 0, "other": 4_000},
            peak_rss_bytes=9_000_000,
        ),
    )
    store = new_store()
    publish(store, "attention", 0, attention)
    ffn = FfnFigures(
        items=40,
        computed=38,
        tokens=300,
        busy_s=1.0,
        redispatched=3,
        up_s=4.0,
        memory=None,
        ranks_per_call={1: 8, 2: 30},
    )
    publish(store, "ffn", 0, ffn)
    raw_set(store, "ffn", 1, {"half": "a document"})  # refused: left out, never an error
    figures = read_back(store, [("attention", 0), ("ffn", 0), ("ffn", 1), ("attention", 1)]).figures()
    assert set(figures) == {("attention", 0), ("ffn", 0)} and figures[("ffn", 0)].at > 0
    assert figures[("ffn", 0)].figures == ffn and figures[("attention", 0)].figures == attention
    health = metrics.Health(failovers=1, replicas=2, placement=("FFN rank 0: experts 0-7",), figures=figures)
    text = metrics.render(metrics.afd_families(1, 2, [], [], {}, ready=True, health=health)).decode()
    got = samples(text)
    assert got[("afd_ffn_failovers_total", ())] == 1 and got[("afd_expert_replicas", ())] == 2
    ffn0 = (("ffn", "0"),)
    assert got[("afd_ffn_items_total", ffn0)] == 40 and got[("afd_ffn_tokens_total", ffn0)] == 300
    assert got[("afd_ffn_redispatched_total", ffn0)] == 3 and got[("afd_ffn_busy_fraction", ffn0)] == 0.25
    engine0 = (("engine", "0"),)
    assert (
        got[("afd_attention_failovers_total", engine0)] == 1 and got[("afd_attention_resent_items_total", engine0)] == 3
    )
    assert got[("afd_attention_hidden_fraction", engine0)] == 0.25
    assert got[("afd_attention_round_trip_seconds_count", engine0)] == 3
    assert got[("afd_attention_round_trip_seconds_sum", engine0)] == 0.306
    assert got[("afd_attention_round_trip_seconds_bucket", (("engine", "0"), ("le", "0.005")))] == 2
    assert got[("afd_attention_round_trip_seconds_bucket", (("engine", "0"), ("le", "+Inf")))] == 3
    attention0 = (("rank", "0"), ("role", "attention"))
    assert got[("afd_role_read_bytes", (("kind", "other"), *attention0))] == 5_000
    assert got[("afd_role_read_bytes", (("kind", "routed_experts"), *attention0))] == 0
    assert got[("afd_role_resident_bytes", (("kind", "other"), *attention0))] == 4_000
    assert got[("afd_role_resident_bytes", (("kind", "routed_experts"), *attention0))] == 0
    assert got[("afd_role_peak_rss_bytes", attention0)] == 9_000_000
    memory_names = {"afd_role_read_bytes", "afd_role_resident_bytes", "afd_role_peak_rss_bytes"}
    memory_samples = {key for key in got if key[0] in memory_names}
    assert len(memory_samples) == 5  # the FFN rank without memory figures has none (no zeros)
    doc = metrics.status(1, 2, [], [], True, None, health)
    assert doc["topology"]["expert_replicas"] == 2 and doc["failovers"] == 1
    assert doc["placement"] == ["FFN rank 0: experts 0-7"] and doc["figures"]["ffn 0"]["items"] == 40
    for role in ("ffn", "attention"):  # the status shows the published document (its keys in its order)
        written = store.live(role, 0)
        assert written is not None
        assert written.pop(SCHEMA_KEY) == SCHEMA_VERSION
        assert doc["figures"][f"{role} 0"] == written and json.dumps(doc["figures"][f"{role} 0"]) == json.dumps(written)
    assert set(doc["figures"]["ffn 0"]) == {
        "items",
        "computed",
        "tokens",
        "busy_s",
        "redispatched",
        "up_s",
        "memory",
        "ranks_per_call",
        "at",
        "pid",
    }
    assert doc["figures"]["attention 0"]["failover"]["first_resend_at"] == {"1": 12.5}
    assert doc["figures"]["ffn 0"]["memory"] is None
    assert doc["figures"]["attention 0"]["memory"] == {
        "peak_rss_bytes": 9_000_000,
        "read_bytes": {"other": 5_000, "routed_experts": 0},
        "resident_bytes": {"other": 4_000, "routed_experts": 0},
    }


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=20) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read().decode()


def post(url: str) -> int:
    req = urllib.request.Request(
        url, json.dumps({"prompt": "x", "max_tokens": 2}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        return resp.status


def test_metrics_and_status_on_a_running_serve(start_serve) -> None:
    serve, _ = start_serve(2, 2, {"token_delay": 0.01})
    url = serve.wait_ready()
    base = url.removesuffix("/v1")
    assert [post(url + "/completions") for _ in range(5)] == [200] * 5
    status, kind, text = get(base + "/metrics")
    assert status == 200 and kind.startswith("text/plain")
    got = samples(text)
    assert got[("afd_ffn_ranks_live", ())] == 2 and got[("afd_attention_ranks_live", ())] == 2
    assert got[("afd_ready", ())] == 1
    assert sum(v for (name, _), v in got.items() if name == "afd_endpoint_requests_total") == 5
    per_engine = {
        dict(labels)["engine"]: v for (name, labels), v in got.items() if name == "vllm:request_success_total"
    }
    assert set(per_engine) == {"0", "1"} and sum(per_engine.values()) == 5  # both engines, told apart
    assert {
        dict(labels)["engine"] for (name, labels), v in got.items() if name == "afd_engine_scrape_ok" and v == 1
    } == {
        "0",
        "1",
    }
    status, kind, body = get(base + "/afd/status")
    doc = json.loads(body)
    assert (
        status == 200 and doc["ready"] is True and doc["topology"] == {"attention": 2, "ffn": 2, "expert_replicas": 1}
    )
    assert doc["live"] == {"attention": [0, 1], "ffn": [0, 1]} and doc["lost"] == {"attention": [], "ffn": []}
    assert sum(e["finished"] for e in doc["requests"].values()) == 5
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0


def test_an_ffn_rank_s_expert_calls_and_ranks_per_call_are_metrics_and_status() -> None:
    """M:N counted: per FFN rank, its expert computations, how many Attention ranks met in each, tokens per call."""
    from afd_mrv2.live_stats import FfnFigures
    from tests.serve.figures_support import new_store, publish, read_back

    store = new_store()
    ffn = FfnFigures(
        items=40,
        computed=38,
        tokens=300,
        busy_s=1.0,
        redispatched=0,
        up_s=4.0,
        memory=None,
        ranks_per_call={1: 8, 2: 30},
    )
    publish(store, "ffn", 0, ffn)
    figures = read_back(store, [("ffn", 0)]).figures()
    assert figures[("ffn", 0)].figures == ffn
    health = metrics.Health(failovers=0, replicas=1, placement=(), figures=figures)
    got = samples(metrics.render(metrics.afd_families(2, 1, [], [], {}, ready=True, health=health)).decode())
    ffn0 = (("ffn", "0"),)
    assert got[("afd_ffn_expert_calls_total", ffn0)] == 38
    assert abs(got[("afd_ffn_tokens_per_call", ffn0)] - 300 / 38) < 1e-9
    assert got[("afd_ffn_ranks_per_call_total", (("ffn", "0"), ("ranks", "1")))] == 8
    assert got[("afd_ffn_ranks_per_call_total", (("ffn", "0"), ("ranks", "2")))] == 30
    doc = metrics.status(2, 1, [], [], True, None, health)
    assert doc["figures"]["ffn 0"]["ranks_per_call"] == {"1": 8, "2": 30}
