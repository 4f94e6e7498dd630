"""The endpoint in front of the fake Attention engines: balancing, streaming, pass-through (16 concurrent clients)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter

import aiohttp

CLIENTS = 16
TOKENS = 20
TOKEN_DELAY = 0.05


async def _complete(session: aiohttp.ClientSession, url: str, stream: bool) -> dict[str, object]:
    body = {"prompt": "x", "max_tokens": TOKENS, "stream": stream}
    t0 = time.monotonic()
    async with session.post(url + "/completions", json=body) as resp:
        assert resp.status == 200
        if not stream:
            data = await resp.json()
            return {"rank": data["rank"], "chunks": 1, "first_s": time.monotonic() - t0, "done": True}
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events, first, ranks = [], None, set()
        async for raw in resp.content:  # line by line, as the proxy hands them on
            line = raw.decode().strip()
            if not line:
                continue
            first = first if first is not None else time.monotonic() - t0
            events.append(line)
            if line != "data: [DONE]":
                ranks.add(json.loads(line.removeprefix("data: "))["rank"])
        assert len(ranks) == 1
        return {
            "rank": ranks.pop(),
            "chunks": len(events) - 1,
            "first_s": first,
            "total_s": time.monotonic() - t0,
            "done": events[-1] == "data: [DONE]",
        }


async def _clients(url: str) -> list[dict[str, object]]:
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(_complete(session, url, stream=i % 2 == 0) for i in range(CLIENTS)))


async def _misc(url: str) -> tuple[int, dict[str, object], int, str, int]:
    base = url.removesuffix("/v1")
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/health") as health:
            health_status = health.status
        async with session.get(url + "/models") as models:
            model_list = await models.json()
        async with session.post(url + "/completions", json={"bad": 1}) as bad:
            bad_status, bad_body = bad.status, await bad.text()
        async with session.get(url + "/nothing-here") as missing:
            missing_status = missing.status
    return health_status, model_list, bad_status, bad_body, missing_status


def test_balances_and_streams_16_concurrent_clients(start_serve):
    serve, _ = start_serve(2, 1, {"token_delay": TOKEN_DELAY})
    url = serve.wait_ready()
    results = asyncio.run(_clients(url))
    assert len(results) == CLIENTS
    # least outstanding requests: 16 concurrent requests split 8 / 8 over the two engines
    assert Counter(r["rank"] for r in results) == {0: CLIENTS // 2, 1: CLIENTS // 2}
    streamed = [r for r in results if "total_s" in r]
    assert len(streamed) == CLIENTS // 2
    for r in streamed:
        assert r["done"] and r["chunks"] == TOKENS
        # unbuffered: the first event arrives long before the stream ends
        assert r["first_s"] < r["total_s"] / 2, r
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0


def test_health_models_and_status_pass_through(start_serve):
    serve, _ = start_serve(1, 1)
    url = serve.wait_ready()
    health, models, bad_status, bad_body, missing = asyncio.run(_misc(url))
    assert health == 200
    assert models["data"][0]["id"] == "fake"
    assert bad_status == 400 and json.loads(bad_body)["error"]["message"] == "bad request"
    assert missing == 404
    serve.signal(signal.SIGINT)
    assert serve.wait() == 0


def _wait_line(serve, text: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in serve.err_lines() if text in line]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no line with {text!r} within {timeout} s:\n" + "\n".join(serve.err_lines()))


def test_a_request_whose_engine_cannot_be_reached_goes_to_another_and_the_engine_is_suspect(start_serve):
    """Engine 1 stops listening while its process runs (serve sees no exit): every request still gets its answer,
    from engine 0; engine 1 is suspect (one line, no new request tries it) until its ``/health`` answers again,
    then the endpoint balances over both."""
    closing = {"rank": 1, "after": 0.5, "for": 4.0}
    serve, _ = start_serve(2, 1, {"token_delay": 0.01, "close_listener": closing})
    url = serve.wait_ready()
    _wait_line(serve, "[attention 1] listener closed")
    results = asyncio.run(_clients(url))  # each asserts its 200 and a whole answer
    assert Counter(r["rank"] for r in results) == {0: CLIENTS}
    assert all(r["done"] for r in results)
    line = _wait_line(serve, "cannot be reached")
    assert line.startswith("[proxy] attention 1 cannot be reached (ClientConnectorError: Cannot connect to host ")
    assert line.endswith(
        "the request goes to attention 0; attention 1 is suspect until its /health answers "
        "(requests already sent to it are retried too)"
    )
    assert sum("cannot be reached" in line for line in serve.err_lines()) == 1  # one line, however many retried
    _wait_line(serve, "[attention 1] listener open again")
    _wait_line(serve, "[proxy] attention 1 answers /health again: it takes requests", timeout=5.0)
    again = asyncio.run(_clients(url))
    assert Counter(r["rank"] for r in again) == {0: CLIENTS // 2, 1: CLIENTS // 2}
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0


def test_with_no_other_engine_an_unreachable_one_answers_502(start_serve):
    serve, _ = start_serve(1, 1, {"close_listener": {"rank": 0, "after": 0.3}})
    url = serve.wait_ready()
    _wait_line(serve, "[attention 0] listener closed")

    async def one() -> tuple[int, dict[str, object]]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/completions", json={"prompt": "x", "max_tokens": 2}) as resp,
        ):
            return resp.status, await resp.json()

    status, body = asyncio.run(one())
    assert status == 502 and body["error"]["message"].startswith("attention 0 failed: ClientConnectorError"), body
    serve.signal(signal.SIGTERM)
    assert serve.wait() == 0
