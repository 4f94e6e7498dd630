"""``afd-mrv2 serve`` with fake roles: start order, the ready line, signals, faults."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from afd_mrv2.procs import alive

STOP_BUDGET_S = 10.0


def post(url: str, body: dict[str, object], timeout: float = 20.0) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError) as exc:  # transport-level error: also an error response
        return -1, repr(exc)


def index_of(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("ffn_ready", ["line", "file"])
def test_ready_line_once_after_every_role_is_ready(start_serve, ffn_ready):
    serve, port = start_serve(2, 2, {"ready_delay": 0.8, "ffn_ready": ffn_ready})
    url = serve.wait_ready()
    assert url == f"http://127.0.0.1:{port}/v1"
    ready_at = next(t for t, line in serve.out if line.startswith("afd-mrv2 serve: ready at"))
    err = serve.err_lines()
    # FFN ranks first, every one ready before the first Attention engine starts
    assert index_of(err, "[serve] ffn rank 0") < index_of(err, "[attention 0] started")
    assert "ffn rank 1" in err[index_of(err, "[serve] ffn rank 0")]
    # every Attention engine was listening before the ready line
    listening = [t for t, line in serve.err if "] listening on " in line]
    assert len(listening) == 2 and max(listening) <= ready_at
    # each role got its own afd section with its role and rank
    argvs = {line.split("]")[0][1:]: json.loads(line.split("] argv ", 1)[1]) for line in err if "] argv " in line}
    assert set(argvs) == {"ffn 0", "ffn 1", "attention 0", "attention 1"}
    for name, argv in argvs.items():
        afd = json.loads(argv[argv.index("--additional-config") + 1])["afd"]
        assert (afd["role"], afd["rank"]) == (name.split()[0], int(name.split()[1]))
        assert (afd["num_attention_ranks"], afd["num_ffn_ranks"]) == (2, 2)
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0
    assert [line for line in serve.out_lines() if line.strip()] == [f"afd-mrv2 serve: ready at {url}"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_process_within_10s(start_serve, sig):
    serve, _ = start_serve(2, 1, {"grandchild": True})
    serve.wait_ready()
    pids = serve.pids()
    assert len(pids) == 6, pids  # 3 roles + a grandchild each
    t0 = time.monotonic()
    serve.signal(sig)
    assert serve.wait() == 0
    elapsed = time.monotonic() - t0
    assert elapsed < STOP_BUDGET_S
    assert [name for name, pid in pids.items() if alive(pid)] == []
    print(f"stop latency ({sig.name}): {elapsed:.2f} s")


@pytest.mark.parametrize("target", ["serve", "its process group"])
def test_a_sigkilled_serve_leaves_no_process_of_its_roles_after_10s(start_serve, target):
    """serve's reaper (a process in a session of its own) stops every role's group, the processes the
    roles started included (the fakes' grandchildren stand for vLLM's EngineCore and workers), and says so."""
    serve, _ = start_serve(2, 1, {"grandchild": True, "ignore_term": True})
    serve.wait_ready()
    pids = serve.pids()
    assert len(pids) == 6, pids  # 3 roles + a grandchild each
    t0 = time.monotonic()
    if target == "serve":
        os.kill(serve.proc.pid, signal.SIGKILL)
    else:
        os.killpg(serve.proc.pid, signal.SIGKILL)
    assert serve.proc.wait(5) == -signal.SIGKILL
    deadline = t0 + 10.0
    while [pid for pid in pids.values() if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    elapsed = time.monotonic() - t0
    assert left == {}, f"still alive {elapsed:.1f} s after serve's SIGKILL: {left}"
    reaped = [line for line in serve.err_lines() if line.startswith("afd-mrv2 serve reaper: ")]
    while not reaped and time.monotonic() < deadline + 5:
        time.sleep(0.1)
        reaped = [line for line in serve.err_lines() if line.startswith("afd-mrv2 serve reaper: ")]
    assert len(reaped) == 1, serve.err_lines()[-5:]
    assert "is gone; stopped the process groups of its roles" in reaped[0] and "SIGKILL to 3" in reaped[0], reaped
    print(f"serve SIGKILLed ({target}): every role process gone within {elapsed:.2f} s")


def test_stop_order_attention_engines_first_then_ffn_ranks(start_serve):
    """FFN ranks end their sessions (and print their reports) when their Attention engines
    are gone, so serve stops the Attention engines first and gives the FFN ranks
    FFN_OWN_END_S to end by themselves before their SIGTERM (these fakes never do)."""
    from afd_mrv2.serve.supervisor import FFN_OWN_END_S

    serve, _ = start_serve(2, 1, {"report_term": True, "ffn_own_end": False})
    serve.wait_ready()
    t0 = time.monotonic()
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0
    elapsed = time.monotonic() - t0
    terms = [(at, line.split("] ", 1)[1]) for at, line in serve.err if "] term " in line]
    assert [text for _, text in terms][-1] == "term ffn 0", terms
    assert sorted(text for _, text in terms[:2]) == ["term attention 0", "term attention 1"], terms
    assert terms[-1][0] - max(at for at, _ in terms[:2]) >= FFN_OWN_END_S - 0.2
    assert elapsed < STOP_BUDGET_S


def test_sigterm_ignored_escalates_to_sigkill(start_serve):
    serve, _ = start_serve(1, 1, {"ignore_term": True}, "--stop-grace-s", "1")
    serve.wait_ready()
    pids = serve.pids()
    t0 = time.monotonic()
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0
    assert time.monotonic() - t0 < STOP_BUDGET_S
    escalated = [line for line in serve.err_lines() if "still running after SIGTERM:" in line]
    assert escalated, serve.err_lines()
    for line in escalated:  # names the processes really still running, and whether the leader is among them
        assert line.rstrip().endswith(": SIGKILL") and "(pid " in line and "its leader, pid" in line, line
    assert [name for name, pid in pids.items() if alive(pid)] == []


def _in_flight(url: str, n: int, stream: bool) -> tuple[list[tuple[int, str]], list[threading.Thread]]:
    results: list[tuple[int, str]] = []
    body = {"prompt": "x", "max_tokens": 200, "stream": stream}
    threads = [threading.Thread(target=lambda: results.append(post(url + "/completions", body))) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


@pytest.mark.parametrize("victim", ["ffn 0", "attention 0"])
def test_killed_role_fails_in_flight_requests_and_serve_exits_naming_it(start_serve, victim):
    """An FFN rank, or the only Attention engine: every in-flight request fails and serve exits 1 naming it."""
    attention = 2 if victim.startswith("ffn") else 1
    serve, _ = start_serve(attention, 1, {"token_delay": 0.05, "grandchild": True})
    url = serve.wait_ready()
    pids = serve.pids()
    plain, plain_threads = _in_flight(url, 4, stream=False)
    streamed, stream_threads = _in_flight(url, 4, stream=True)
    time.sleep(1.0)  # mid-generation: 200 tokens take 10 s
    t0 = time.monotonic()
    signal_pid = pids[victim]
    os.kill(signal_pid, signal.SIGKILL)
    rc = serve.wait()
    elapsed = time.monotonic() - t0
    for t in plain_threads + stream_threads:
        t.join(10)
        assert not t.is_alive(), "a client hangs"
    assert rc != 0 and elapsed < STOP_BUDGET_S
    role, rank = victim.split()
    last = serve.err_lines()[-1]
    assert (
        last
        == f"afd-mrv2 serve: error: {role} rank {rank} (pid {signal_pid}) exited (signal SIGKILL); stopped every role"
    )
    assert len(plain) == 4 and all(status != 200 for status, _ in plain), plain
    # streams started with 200; each ends with an error event and never with [DONE]
    assert len(streamed) == 4
    for status, text in streamed:
        assert status != 200 or ('"error"' in text and "[DONE]" not in text), text
    assert [name for name, pid in pids.items() if alive(pid)] == []
    print(f"fault ({victim}) -> serve exit: {elapsed:.2f} s")


def test_a_killed_engine_of_two_fails_only_its_requests_and_the_endpoint_serves_on(start_serve):
    """With two Attention engines, one that dies takes only its own in-flight requests along (each gets an
    error, never a hang); the endpoint routes every later request to the survivor, and serve keeps running
    until told to stop (this changed: serve used to stop every role).  ``--no-restart-attention``: the
    engine stays lost."""
    serve, _ = start_serve(2, 1, {"token_delay": 0.025, "grandchild": True}, "--no-restart-attention")
    url = serve.wait_ready()
    base = url.removesuffix("/v1")
    pids = serve.pids()
    plain, plain_threads = _in_flight(url, 4, stream=False)
    streamed, stream_threads = _in_flight(url, 4, stream=True)
    time.sleep(1.0)  # mid-generation: 200 tokens take 5 s
    t0 = time.monotonic()
    os.kill(pids["attention 1"], signal.SIGKILL)
    for t in plain_threads + stream_threads:
        t.join(20)
        assert not t.is_alive(), "a client hangs"
    ok = [text for status, text in plain + streamed if status == 200 and '"error"' not in text]
    failed = [text for status, text in plain + streamed if status != 200 or '"error"' in text]
    assert len(ok) == 4 and len(failed) == 4, (ok, failed)  # least-outstanding: four on each engine
    assert all('"rank": 0' in text for text in ok) and all("[DONE]" not in text for text in failed)
    assert serve.proc.poll() is None  # serve serves on
    line = next(line for line in serve.err_lines() if "the endpoint serves on with" in line)
    assert line == (
        f"[serve] attention rank 1 (pid {pids['attention 1']}) exited (signal SIGKILL): "
        "the endpoint serves on with attention 0 (1 of 2 Attention engines)"
    )
    after = [post(url + "/completions", {"prompt": "x", "max_tokens": 3}) for _ in range(4)]
    assert all(status == 200 and '"rank": 0' in text for status, text in after), after
    with urllib.request.urlopen(base + "/afd/status", timeout=10) as resp:
        status = json.loads(resp.read())
    assert status["live"]["attention"] == [0] and status["lost"]["attention"] == [1] and status["ready"] is True
    with urllib.request.urlopen(base + "/health", timeout=10) as resp:
        assert resp.status == 200
    print(f"engine loss -> in-flight answered and failed within {time.monotonic() - t0:.2f} s")
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0
    assert serve.err_lines()[-1] == (
        f"[serve] stopped every role (SIGTERM) (lost earlier: attention rank 1 (pid {pids['attention 1']}))"
    )
    assert [name for name, pid in pids.items() if alive(pid)] == []


def test_a_killed_engine_of_two_is_restarted_and_the_endpoint_routes_to_it_again(start_serve):
    """By default serve restarts a lost engine of several: once the new process is ready the endpoint
    routes to it again (a new pid answers), ``/metrics`` counts the restart and ``/afd/status`` lists the
    engine as live."""
    serve, _ = start_serve(2, 1, {"token_delay": 0.01, "grandchild": True})
    url = serve.wait_ready()
    base = url.removesuffix("/v1")
    old = serve.pids()["attention 1"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not any("restarted: ready after" in line for line in serve.err_lines()):
        assert time.monotonic() < deadline and serve.proc.poll() is None, serve.err_lines()
        time.sleep(0.1)
    new = serve.pids()["attention 1"]
    assert new != old
    line = next(line for line in serve.err_lines() if "restarted: ready after" in line)
    assert line.startswith(f"[serve] attention rank 1 (pid {new}) restarted: ready after ") and line.endswith(
        " s; the endpoint routes to it again"
    ), line
    answers = [post(url + "/completions", {"prompt": "x", "max_tokens": 2}) for _ in range(4)]
    assert all(status == 200 for status, _ in answers) and any(f'"pid": {new}' in text for _, text in answers)
    with urllib.request.urlopen(base + "/afd/status", timeout=10) as resp:
        status = json.loads(resp.read())
    assert status["live"]["attention"] == [0, 1] and status["restarts"] == {"attention 1": 1}, status
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'afd_role_restarts_total{rank="1",role="attention"} 1.0' in text, text
    assert "afd_degraded 0.0" in text and "afd_role_restarts_exhausted{" not in text, text  # it is back
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0
    assert serve.err_lines()[-1] == f"[serve] stopped every role (SIGTERM) (lost earlier: attention rank 1 (pid {old}))"


def test_an_engine_whose_restarts_are_used_up_is_a_metric_and_a_line(start_serve):
    """After MAX_RESTARTS restarts of one engine its next loss is final: serve serves on with the other one,
    says so in one line, and ``/metrics`` and ``/afd/status`` say it runs degraded, and why."""
    from afd_mrv2.serve.supervisor import MAX_RESTARTS

    serve, _ = start_serve(2, 1, {"token_delay": 0.01})
    url = serve.wait_ready()
    base = url.removesuffix("/v1")
    for restart in range(MAX_RESTARTS + 1):
        os.kill(serve.pids()["attention 1"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        if restart < MAX_RESTARTS:
            while sum("restarted: ready after" in line for line in serve.err_lines()) <= restart:
                assert time.monotonic() < deadline and serve.proc.poll() is None, serve.err_lines()
                time.sleep(0.1)
    deadline = time.monotonic() + 10
    while not any("not restarted again" in line for line in serve.err_lines()):
        assert time.monotonic() < deadline and serve.proc.poll() is None, serve.err_lines()
        time.sleep(0.1)
    line = next(line for line in serve.err_lines() if "not restarted again" in line)
    assert line == (
        f"[serve] attention 1: not restarted again ({MAX_RESTARTS} restarts already); serve runs degraded "
        "(afd_role_restarts_exhausted, afd_degraded)"
    ), line
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'afd_role_restarts_exhausted{rank="1",role="attention"} 1.0' in text and "afd_degraded 1.0" in text, text
    with urllib.request.urlopen(base + "/afd/status", timeout=10) as resp:
        status = json.loads(resp.read())
    assert status["restarts_exhausted"] == ["attention 1"] and status["degraded"] == ["attention 1"], status
    assert post(url + "/completions", {"prompt": "x", "max_tokens": 2})[0] == 200  # engine 0 serves on
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0


def test_a_stalled_ffn_rank_an_engine_failed_over_is_ended_and_restarted(start_serve):
    """FFN rank 1 stops (SIGSTOP) and the engine stops routing to it (its live figures say so, as after
    ``recv_timeout_s``): serve ends the stalled process's group within seconds, fails it over (replicas) and
    restarts it."""
    serve, _ = start_serve(
        1, 2, {"grandchild": True, "report_lost_ffn": {"rank": 1, "after": 1.0}}, "--expert-replicas", "2"
    )
    serve.wait_ready()
    pids = serve.pids()
    os.kill(pids["ffn 1"], signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not any("restarted: ready after" in line for line in serve.err_lines()):
        assert time.monotonic() < deadline and serve.proc.poll() is None, serve.err_lines()[-10:]
        time.sleep(0.1)
    stalled = [line for line in serve.err_lines() if " is stalled: " in line]
    assert stalled == [
        f"[serve] ffn rank 1 (pid {pids['ffn 1']}) is stalled: attention rank 0 stopped routing to it (FFN rank 0 "
        "sent nothing within 2 s) while its process runs: SIGKILL"
    ], stalled
    assert any("its experts are served by their other holders" in line for line in serve.err_lines())
    assert not alive(pids["ffn 1"]) and not alive(pids["grandchild of ffn 1"])
    assert serve.pids()["ffn 1"] != pids["ffn 1"]  # restarted, and not ended again (started after the loss)
    time.sleep(2.5)
    assert len([line for line in serve.err_lines() if " is stalled: " in line]) == 1
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0


def test_with_expert_replicas_a_killed_ffn_rank_is_survived_and_the_last_holder_is_not(start_serve):
    """``--expert-replicas 2`` at 1A2F: the loss of FFN rank 1 leaves every expert a live holder, so serve
    serves on (the engines fail over by themselves) and says so in one line; losing FFN rank 0 as well
    leaves none, and serve stops as without replicas, naming it."""
    serve, _ = start_serve(
        1, 2, {"token_delay": 0.01, "grandchild": True}, "--expert-replicas", "2", "--no-restart-ffn"
    )
    url = serve.wait_ready()
    base = url.removesuffix("/v1")
    pids = serve.pids()
    placement = [line for line in serve.err_lines() if line.startswith("[serve] placement:")]
    assert placement == [
        "[serve] placement: 2 expert blocks on 2 FFN ranks, 2 each",
        "[serve] placement: FFN rank 0: blocks 0-1 (2; primary 0)",
        "[serve] placement: FFN rank 1: blocks 0-1 (2; primary 1)",
    ], placement
    os.kill(pids["ffn 1"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not any("its experts are served by" in line for line in serve.err_lines()):
        assert time.monotonic() < deadline and serve.proc.poll() is None, serve.err_lines()
        time.sleep(0.1)
    line = next(line for line in serve.err_lines() if "its experts are served by" in line)
    assert line == (
        f"[serve] ffn rank 1 (pid {pids['ffn 1']}) exited (signal SIGKILL): its experts are served by their other "
        "holders, FFN rank(s) 0 (1 of 2 live)"
    )
    assert post(url + "/completions", {"prompt": "x", "max_tokens": 3})[0] == 200
    with urllib.request.urlopen(base + "/afd/status", timeout=10) as resp:
        status = json.loads(resp.read())
    assert status["live"]["ffn"] == [0] and status["lost"]["ffn"] == [1] and status["ready"] is True
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "afd_ffn_ranks_live 1.0" in text and "afd_ffn_failovers_total 1.0" in text, text
    assert "afd_degraded 1.0" in text and status["degraded"] == ["ffn 1"], (text, status)
    os.kill(pids["ffn 0"], signal.SIGKILL)
    assert serve.wait() == 1
    assert serve.err_lines()[-1] == (
        f"afd-mrv2 serve: error: ffn rank 0 (pid {pids['ffn 0']}) exited (signal SIGKILL); stopped every role "
        f"(lost earlier: ffn rank 1 (pid {pids['ffn 1']}))"
    )
    assert [name for name, pid in pids.items() if alive(pid)] == []


def test_backend_dying_mid_response_gives_error_not_hang(start_serve):
    serve, _ = start_serve(1, 1, {"token_delay": 0.02})
    url = serve.wait_ready()
    status, text = post(url + "/completions", {"prompt": "die", "max_tokens": 20, "stream": True}, timeout=15)
    assert status == 200 and '"error"' in text and "[DONE]" not in text
    assert serve.wait() == 1
    assert "attention rank 0" in serve.err_lines()[-1]


def test_role_dying_during_startup(start_serve):
    serve, _ = start_serve(1, 1, {"exit_after": 0.1, "ready_delay": 0.1})
    rc = serve.wait()
    assert rc == 1
    assert [line for line in serve.out_lines() if line.strip()] == []
    assert "afd-mrv2 serve: error: ffn rank 0" in serve.err_lines()[-1] and "exit code 3" in serve.err_lines()[-1]


def _cores_said(serve) -> tuple[str, dict[str, list[str]]]:
    """serve's one ``[serve] cores:`` line, and per role what its fake says: its cores, ``grandchild``, the
    grandchild's cores."""
    err = serve.err_lines()
    (line,) = [x for x in err if x.startswith("[serve] cores: ")]
    said = [x.split("] ", 1)[1].split() for x in err if "] cores " in x]  # cores ROLE RANK LIST grandchild LIST
    return line, {" ".join(words[1:3]): words[3:] for words in said}


def test_with_more_processes_than_cores_the_ffn_rank_runs_on_any_core(start_serve):
    """Two engines and one FFN rank on 2 cores: each engine keeps its core, the FFN rank's process is pinned to
    none (every core of serve's affinity) and the line says so."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        pytest.fail(f"this test needs exactly 2 cores in serve's affinity, the machine gives {cores}")
    serve, _ = start_serve(2, 1, {"grandchild": True})
    serve.wait_ready()
    line, pinned = _cores_said(serve)
    assert line.startswith(f"[serve] cores: attention 0 -> {cores[0]}, attention 1 -> {cores[1]}, ffn 0 -> any ("), line
    assert line.endswith("('any': fewer cores than processes, left to the scheduler)"), line
    both = ",".join(map(str, cores))
    assert pinned["ffn 0"] == [both, "grandchild", both], pinned
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0


def test_ready_timeout(start_serve):
    serve, _ = start_serve(1, 1, {"ready_delay": 30}, "--ready-timeout-s", "1")
    assert serve.wait() == 1
    assert "not ready after 1 s" in serve.err_lines()[-1]


def test_a_role_whose_group_member_died_first_is_reported_with_that_cause(start_serve):
    """vLLM's API server exits 0 some time after its EngineCore was killed: serve names the process that
    ended first instead of reporting a bare 'exit code 0'."""
    serve, _ = start_serve(1, 1, {"grandchild": True, "grandchild_dies_after": 3.0})
    serve.wait_ready()
    pids = serve.pids()
    assert serve.wait() == 1
    last = serve.err_lines()[-1]
    assert last == (
        f"afd-mrv2 serve: error: ffn rank 0 (pid {pids['ffn 0']}) exited (exit code 0, after sleep "
        f"(pid {pids['grandchild of ffn 0']}) of its process group had ended); stopped every role"
    ), last


def test_every_process_of_a_role_runs_on_the_role_s_cores(start_serve):
    """Issue 27 item 1: serve pins each role's process, so what it starts (vLLM's EngineCore and workers; here the
    fake's grandchild) inherits the role's cores, and says so in one line."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.fail(f"this test needs 2 cores in serve's affinity, the machine gives {cores}")
    serve, _ = start_serve(1, 1, {"grandchild": True})
    serve.wait_ready()
    line, pinned = _cores_said(serve)
    assert line.startswith(f"[serve] cores: attention 0 -> {cores[0]}, ffn 0 -> {cores[1]} ("), line
    assert pinned == {
        "attention 0": [str(cores[0]), "grandchild", str(cores[0])],
        "ffn 0": [str(cores[1]), "grandchild", str(cores[1])],
    }, pinned
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0
