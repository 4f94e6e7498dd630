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
