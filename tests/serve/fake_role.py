"""A fake role process for the serve tests (no vLLM): ``fake_role.py ROLE RANK [--port P] [--ready-file F] ...``.

Behaviour comes from the ``FAKE_ROLE`` environment variable (JSON):

* ``ready_delay`` (s, default 0.2) before it is ready; ``ffn_ready``: ``"line"`` (prints the
  marker) or ``"file"`` (creates ``--ready-file``);
* ``grandchild``: spawn a ``sleep`` child in the same process group (serve must stop it too);
* ``grandchild_dies_after``: seconds after ready, kill that child, then exit 0 a second later;
* ``ignore_term``: ignore SIGTERM (serve must escalate to SIGKILL);
* ``report_term``: on SIGTERM print ``term <ROLE> <RANK>``, then exit 0;
* ``exit_after`` (s): exit with code 3 after this long;
* ``report_lost_ffn`` (``{"rank": F, "after": S}``): an Attention fake publishes live figures in the rendezvous
  store (its ``afd`` section's, with serve's secret) saying it stopped routing to FFN rank F, S seconds after
  it is ready;
* ``close_listener`` (``{"rank": R, "after": S, "for": T}``): Attention fake R closes its listening socket S
  seconds after it listens (``listener closed``; its process runs on, so serve sees no exit) and listens again
  T seconds later (``listener open again``; never without ``for``);
* ``token_delay`` (s, default 0.05): delay between streamed tokens;
* ``ffn_own_end`` (default true): an FFN fake ends by itself (prints ``afd-mrv2 ffn: done {}``, exits 0)
  once every Attention fake of its serve is gone, as a real FFN rank ends its session when its
  Attention engines are; false: it runs until signalled.  Attention fakes announce their pids as
  ``fake-attention-<rank>.pid`` in ``$AFD_MRV2_STATS_DIR`` (the run directory serve gives every role).

An Attention fake binds ``--host`` (127.0.0.1 without it) and serves ``/health``, ``/v1/models`` and ``/v1/completions`` (a JSON body,
or SSE chunks with ``"stream": true``) with aiohttp; the completion names the rank and pid.
Its ``/metrics`` is what a vLLM OpenAI server exports, made the way vLLM makes it
(``prometheus_client``; every sample labelled ``engine="0"``, as each independent engine does):
a gauge, a counter of finished requests and a latency histogram.
A prompt ``"die"`` makes the process SIGKILL itself in the middle of the response.
Every fake prints ``pid <ROLE> <RANK> <PID>`` (and ``grandchild <PID>`` and ``cores <ROLE> <RANK> <LIST>
grandchild <LIST>``, the CPU affinities) so tests can check them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from afd_mrv2.procs import alive

MARKER = "afd-mrv2 ffn: ready"
POLL_S = 0.05
BACKGROUND: set[asyncio.Future[None]] = set()  # holds the tasks that run until the process exits


def _opt(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def completion(rank: int, text: str) -> dict[str, object]:
    return {
        "id": f"cmpl-{rank}-{time.monotonic_ns()}",
        "object": "text_completion",
        "model": "fake",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "rank": rank,
        "pid": os.getpid(),
    }


def attention_app(rank: int, behaviour: dict[str, object]) -> web.Application:
    delay = float(behaviour.get("token_delay", 0.05))  # type: ignore[arg-type]
    registry = CollectorRegistry()
    labels = {"engine": "0", "model_name": "fake"}
    running = Gauge("vllm:num_requests_running", "Requests running.", list(labels), registry=registry)
    finished = Counter("vllm:request_success", "Finished requests.", list(labels), registry=registry)
    latency = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", list(labels), registry=registry)
    running.labels(**labels).set(0)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        running.labels(**labels).inc()
        try:
            return await complete(request)
        finally:
            running.labels(**labels).dec()
            finished.labels(**labels).inc()
            latency.labels(**labels).observe(time.monotonic() - started)

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tokens = int(body.get("max_tokens", 4))
        die = body.get("prompt") == "die"
        if body.get("bad"):
            return web.json_response({"error": {"message": "bad request", "code": 400}}, status=400)
        if not body.get("stream"):
            for i in range(tokens):
                if die and i == tokens // 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                await asyncio.sleep(delay)
            return web.json_response(completion(rank, " tok" * tokens))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            if die and i == tokens // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            await resp.write(f"data: {json.dumps(completion(rank, f' t{i}'))}\n\n".encode())
            await asyncio.sleep(delay)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


def _attention_pids(run_dir: Path) -> list[int]:
    pids = []
    for path in run_dir.glob("fake-attention-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(path.read_text()))
    return pids


async def end_with_attention(run_dir: Path) -> None:
    """Exit 0 once every Attention fake that announced itself is gone (a real FFN rank's own end)."""
    while True:
        pids = _attention_pids(run_dir)
        if pids and not any(alive(pid) for pid in pids):
            print("afd-mrv2 ffn: done {}", flush=True)
            os._exit(0)
        await asyncio.sleep(POLL_S)


async def main(argv: list[str]) -> None:
    role, rank = argv[0], int(argv[1])
    behaviour = json.loads(os.environ.get("FAKE_ROLE", "{}"))
    if behaviour.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif behaviour.get("report_term"):

        def on_term(signum: int, frame: object) -> None:
            print(f"term {role} {rank}", flush=True)
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)
    print(f"pid {role} {rank} {os.getpid()}", flush=True)
    print(f"argv {json.dumps(argv)}", flush=True)
    if behaviour.get("grandchild"):
        child = subprocess.Popen(["sleep", "600"])
        print(f"grandchild {child.pid}", flush=True)
        # where this process and the one it started run (serve pins every process of a role)
        mine, its = sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(child.pid))
        print(f"cores {role} {rank} {','.join(map(str, mine))} grandchild {','.join(map(str, its))}", flush=True)
    await asyncio.sleep(float(behaviour.get("ready_delay", 0.2)))
    run_dir = os.environ.get("AFD_MRV2_STATS_DIR")
    if role == "ffn":
        if behaviour.get("ffn_own_end", True) and run_dir:
            BACKGROUND.add(asyncio.ensure_future(end_with_attention(Path(run_dir))))
        ready_file = _opt(argv, "--ready-file")
        if behaviour.get("ffn_ready", "line") == "file" and ready_file:
            Path(ready_file).write_text("ready\n")
        else:
            print(f"{MARKER} (fake rank {rank})", flush=True)
    else:
        await listen(argv, rank, behaviour, run_dir)
    if "grandchild_dies_after" in behaviour:  # like vLLM's EngineCore dying under its API server
        await asyncio.sleep(float(behaviour["grandchild_dies_after"]))
        child.kill()
        child.wait()
        await asyncio.sleep(1.0)  # the leader notices later and exits 0, as vLLM's API server does
        sys.exit(0)
    if "exit_after" in behaviour:
        await asyncio.sleep(float(behaviour["exit_after"]))
        print("exiting on purpose", flush=True)
        sys.exit(3)
    await asyncio.sleep(3600)


async def listen(argv: list[str], rank: int, behaviour: dict[str, Any], run_dir: str | None) -> None:
    """An Attention fake's server on ``--host``/``--port``, with the behaviours that act on it."""
    runner = web.AppRunner(attention_app(rank, behaviour), access_log=None)
    await runner.setup()
    where = (_opt(argv, "--host") or "127.0.0.1", int(_opt(argv, "--port") or 0))
    site = web.TCPSite(runner, *where)
    await site.start()
    print(f"listening on {_opt(argv, '--port')}", flush=True)
    closing = behaviour.get("close_listener")
    if isinstance(closing, dict) and int(closing["rank"]) == rank:
        BACKGROUND.add(asyncio.ensure_future(close_listener(runner, site, where, closing)))
    if run_dir:
        Path(run_dir, f"fake-attention-{rank}.pid").write_text(str(os.getpid()))
    if "report_lost_ffn" in behaviour:
        afd = json.loads(_opt(argv, "--additional-config") or "{}")["afd"]
        BACKGROUND.add(asyncio.ensure_future(report_lost(afd, rank, behaviour["report_lost_ffn"])))


async def close_listener(
    runner: web.AppRunner, site: web.TCPSite, where: tuple[str, int], spec: dict[str, Any]
) -> None:
    """Stop listening after ``spec["after"]`` s (new connections are refused; the process runs on), and listen
    again on the same address ``spec["for"]`` s later, if given."""
    await asyncio.sleep(float(spec["after"]))
    await site.stop()
    print("listener closed", flush=True)
    if "for" not in spec:
        return
    await asyncio.sleep(float(spec["for"]))
    await web.TCPSite(runner, *where).start()
    print("listener open again", flush=True)


async def report_lost(afd: dict[str, Any], rank: int, spec: dict[str, Any]) -> None:
    """After ``spec["after"]`` s, publish this engine's live figures saying it stopped routing to FFN rank
    ``spec["rank"]`` (as a real engine's failover after ``recv_timeout_s`` does), in the store as a real
    engine's publisher does."""
    from afd_mrv2.live_stats import AttentionFigures, FailoverFigures, FiguresPublisher, Histogram, LostRank, encode
    from afd_mrv2.mrv2.transport.store import RendezvousStore

    await asyncio.sleep(float(spec["after"]))
    lost = {int(spec["rank"]): LostRank(at=round(time.time(), 3), reason="FFN rank 0 sent nothing within 2 s")}
    failover = FailoverFigures(
        failovers=1, lost=lost, first_resend_at={}, resent_items=0, resent_rows=0, rejoins=0, rejoined_at={}
    )
    figures = AttentionFigures(
        calls=0,
        tokens=0,
        round_trip_seconds=Histogram().figures(),
        round_trip_total_s=0.0,
        hidden_total_s=0.0,
        failover=failover,
        memory=None,
    )
    store = await asyncio.to_thread(RendezvousStore.connect, afd["host"], int(afd["port"]), master=False, timeout_s=10)
    publisher = FiguresPublisher(
        "attention", lambda w: store.publish_live("attention", rank, encode(w)), lambda: figures
    )
    await asyncio.to_thread(publisher.publish_now)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
