"""The one OpenAI-compatible endpoint in front of the Attention engines: a small balancing proxy on aiohttp.

:class:`Proxy` (``mark_lost``, ``fail_all``).

See docs/internals/serve.md, "afd_mrv2.serve.proxy".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

import aiohttp
from aiohttp import web

from afd_mrv2.serve import metrics

log = logging.getLogger(__name__)

BALANCE = ("least-outstanding", "round-robin")
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


class ProxyDown(Exception):
    """Raised into in-flight exchanges by :meth:`Proxy.fail_all`."""


BACKEND_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError, RuntimeError, ProxyDown)
#: a backend exchange that failed before any byte of the request left: the connection was refused, reset or
#: unreachable while it was being made, or not made in time (the request may go to another engine)
NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
#: how often a suspect backend's ``/health`` is asked whether it serves again, and how long each ask may take
SUSPECT_LOOK_S = 1.0
T = TypeVar("T")


class NotSent(Exception):
    """A backend exchange failed before the request was sent (:data:`NOT_SENT`): ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class Backend:
    name: str
    url: str
    #: the endpoint's ``engine`` label of its first vLLM engine (a group's DP rank i is ``engine + i``)
    engine: int = 0
    outstanding: int = 0
    served: int = 0
    #: why this engine is out of the rotation (None: serving)
    lost: str | None = None
    #: set when it is lost: breaks its in-flight exchanges
    gone: asyncio.Future[None] | None = None
    #: why it is suspect (a connection to it failed before a request was sent): picked only when every
    #: serving backend is, until its ``/health`` answers 200 or it is revived (None: not suspect)
    suspect: str | None = None


def error_body(status: int, message: str) -> dict[str, object]:
    kind = "BadGateway" if status == 502 else "ServiceUnavailable" if status == 503 else "ProxyError"
    return {"error": {"message": message, "type": kind, "code": status}, "object": "error"}


class Proxy:
    """Balance requests over ``backends`` (``(name, base_url)`` pairs)."""

    def __init__(
        self,
        backends: Sequence[tuple[str, str]],
        *,
        balance: str = BALANCE[0],
        log: TextIO,
        num_ffn: int = 0,
        roles: metrics.RoleStates = tuple,
        health: metrics.HealthNow = metrics.Health,
        engines: Sequence[int] | None = None,
    ) -> None:
        """``backends``: the Attention groups (a group of one: an engine) in rank order; ``roles``: the role
        processes' states now (for ``/metrics`` and ``/afd/status``), ``num_ffn`` the topology's FFN ranks;
        ``engines``: each backend's first ``engine`` label (its first DP rank; default: its index)."""
        if balance not in BALANCE:
            raise ValueError(f"balance: expected one of {', '.join(BALANCE)}, got {balance!r}")
        firsts = list(range(len(backends))) if engines is None else list(engines)
        self.backends = [Backend(name, url, first) for (name, url), first in zip(backends, firsts, strict=True)]
        self.balance = balance
        self.log = log
        self.num_ffn = num_ffn
        self.roles = roles
        self.health = health
        self.ready = False
        self.down: str | None = None
        self._turn = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._down: asyncio.Future[None] | None = None
        self._looks: set[asyncio.Future[None]] = set()

    # ------------------------------------------------------------ lifecycle

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (503 for everything until :attr:`ready`)."""
        loop = asyncio.get_running_loop()
        self._down = loop.create_future()
        for backend in self.backends:
            backend.gone = loop.create_future()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/afd/status", self._status)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            auto_decompress=False,
        )
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, reuse_address=True).start()

    def mark_lost(self, index: int, reason: str) -> None:
        """Take backend ``index`` out of the rotation and break its in-flight exchanges (their clients get
        an error); the other backends go on."""
        backend = self.backends[index]
        backend.lost = reason
        if backend.gone is not None and not backend.gone.done():
            backend.gone.set_result(None)

    def revive(self, index: int) -> None:
        """Backend ``index`` (a restarted engine, ready) takes requests again."""
        backend = self.backends[index]
        backend.lost = None
        backend.suspect = None
        backend.gone = asyncio.get_running_loop().create_future()

    def serving(self) -> list[Backend]:
        """The backends in the rotation."""
        return [b for b in self.backends if b.lost is None]

    async def fail_all(self, reason: str) -> None:
        """Refuse new requests and break every in-flight backend exchange (their clients get an error)."""
        self.down = reason
        if self._down is not None and not self._down.done():
            self._down.set_result(None)
        await asyncio.sleep(0)  # let the broken exchanges answer their clients

    async def _unless_down(self, step: Awaitable[T], backend: Backend) -> T:
        """Await one backend step, or raise :class:`ProxyDown` as soon as :meth:`fail_all` ran or
        ``backend`` was lost (:meth:`mark_lost`)."""
        task: asyncio.Future[T] = asyncio.ensure_future(step)
        assert self._down is not None and backend.gone is not None
        waits: set[asyncio.Future[Any]] = {task, self._down, backend.gone}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, *BACKEND_ERRORS):
            await task
        raise ProxyDown(self.down or backend.lost)

    async def close(self) -> None:
        for look in self._looks:
            look.cancel()
        if self._session is not None and not self._session.closed:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------ routing

    def pick(self, *, besides: Backend | None = None) -> Backend:
        """The next backend in the rotation (:meth:`serving`, other than ``besides``; those not suspect first;
        :class:`ProxyDown` when none is left)."""
        serving = [b for b in self.serving() if b is not besides]
        if not serving:
            raise ProxyDown("no Attention engine is serving")
        serving = [b for b in serving if b.suspect is None] or serving
        turn = next(self._turn)
        n = len(serving)
        order = [serving[(turn + i) % n] for i in range(n)]
        if self.balance == "round-robin":
            return order[0]
        return min(order, key=lambda b: b.outstanding)  # min() keeps the first of equals: round robin on ties

    async def _health(self, request: web.Request) -> web.Response:
        if self.ready and self.down is None and self.serving():
            return web.Response(status=200)
        return web.json_response(error_body(503, self.down or "starting"), status=503)

    def _engine_counts(self) -> list[metrics.EngineCount]:
        return [metrics.EngineCount(rank, b.served, b.outstanding) for rank, b in enumerate(self.backends)]

    async def _scrape(self, rank: int, backend: Backend) -> list[metrics.Metric] | None:
        """One engine's own metrics, relabelled; None when it does not answer in time (or is down)."""
        if self._session is None:
            return None
        try:
            timeout = aiohttp.ClientTimeout(total=metrics.SCRAPE_TIMEOUT_S)
            async with self._session.get(backend.url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                text = (await resp.read()).decode(errors="replace")
            return metrics.relabel(text, backend.engine)
        except (*BACKEND_ERRORS, ValueError) as exc:
            log.debug("metrics of %s: %s", backend.name, exc)
            return None

    async def _metrics(self, request: web.Request) -> web.Response:
        scraped = await asyncio.gather(*(self._scrape(rank, b) for rank, b in enumerate(self.backends)))
        engines = metrics.merge(f for families in scraped if families for f in families)
        ready = self.ready and self.down is None
        afd = metrics.afd_families(
            len(self.backends),
            self.num_ffn,
            self.roles(),
            self._engine_counts(),
            {rank: families is not None for rank, families in enumerate(scraped)},
            ready,
            self.health(),
        )
        body = metrics.render([*afd, *engines])
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    async def _status(self, request: web.Request) -> web.Response:
        doc = metrics.status(
            len(self.backends), self.num_ffn, self.roles(), self._engine_counts(), self.ready, self.down, self.health()
        )
        return web.json_response(doc)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if not self.ready or self.down is not None or self._session is None:
            return web.json_response(error_body(503, self.down or "afd-mrv2 serve is starting"), status=503)
        try:
            backend = self.pick()
        except ProxyDown as exc:
            return web.json_response(error_body(503, str(exc)), status=503)
        return await self._exchange(request, backend, self._session, retry=True)

    async def _exchange(
        self, request: web.Request, backend: Backend, session: aiohttp.ClientSession, *, retry: bool
    ) -> web.StreamResponse:
        """Relay ``request`` to ``backend``; where its connection fails before the request was sent, once more to
        another live backend when ``retry`` (``backend`` is then suspect: :meth:`_suspect`)."""
        backend.outstanding += 1
        try:
            response = await self._relay(request, backend, session)
        except NotSent as exc:
            other = self._suspect(backend, exc.cause, retry=retry)
            if other is None:  # no other live engine, or this was the one retry
                return self._failed(backend, exc.cause)
            return await self._exchange(request, other, session, retry=False)
        finally:
            backend.outstanding -= 1
        backend.served += 1
        return response

    def _suspect(self, backend: Backend, cause: BaseException, *, retry: bool) -> Backend | None:
        """``backend`` could not be reached: mark it suspect (one line; its ``/health`` is asked every second until
        it answers); with ``retry``, return another live backend for the request (None when there is none)."""
        try:
            other = self.pick(besides=backend) if retry else None
        except ProxyDown:
            other = None
        if backend.suspect is None and backend.lost is None and self.down is None:
            backend.suspect = f"{type(cause).__name__}: {cause}".rstrip(": ")
            look = asyncio.ensure_future(self._look_at(backend))
            self._looks.add(look)
            look.add_done_callback(self._looks.discard)
            then = f"the request goes to {other.name}" if other is not None else "no other engine takes the request"
            print(
                f"[proxy] {backend.name} cannot be reached ({backend.suspect}): {then}; {backend.name} is suspect "
                "until its /health answers (requests already sent to it are retried too)",
                file=self.log,
                flush=True,
            )
        return other

    async def _look_at(self, backend: Backend) -> None:
        """Ask a suspect ``backend``'s ``/health`` every :data:`SUSPECT_LOOK_S` until it answers 200 (it is then
        picked again), it is lost or revived, or the proxy stops."""
        timeout = aiohttp.ClientTimeout(total=SUSPECT_LOOK_S)
        while backend.suspect is not None and backend.lost is None and self.down is None:
            await asyncio.sleep(SUSPECT_LOOK_S)
            if self._session is None or self._session.closed:
                return
            try:
                async with self._session.get(backend.url + "/health", timeout=timeout) as resp:
                    healthy = resp.status == 200
            except BACKEND_ERRORS:
                continue
            if healthy and backend.suspect is not None and backend.lost is None:
                backend.suspect = None
                print(f"[proxy] {backend.name} answers /health again: it takes requests", file=self.log, flush=True)

    async def _relay(
        self, request: web.Request, backend: Backend, session: aiohttp.ClientSession
    ) -> web.StreamResponse:
        """Relay ``request`` to ``backend`` and its response back; :class:`NotSent` when the connection failed
        before the request was sent (nothing was answered yet)."""
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            upstream = await self._unless_down(
                session.request(
                    request.method, backend.url + request.path_qs, data=body, headers=headers, allow_redirects=False
                ),
                backend,
            )
        except NOT_SENT as exc:
            raise NotSent(exc) from exc
        except BACKEND_ERRORS as exc:
            return self._failed(backend, exc)
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    resp.headers.add(key, value)
            if upstream.content_length is not None:
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            while True:
                try:
                    chunk = await self._unless_down(upstream.content.readany(), backend)
                except BACKEND_ERRORS as exc:
                    await self._failed_midway(request, resp, upstream, backend, exc)
                    return resp
                if not chunk:
                    break
                try:
                    await resp.write(chunk)
                except ConnectionError:  # the client went away: release (closes) the upstream exchange
                    self._client_gone(request)
                    return resp
            try:
                await resp.write_eof()
            except ConnectionError:  # the client closed after the last chunk (e.g. after data: [DONE]): normal
                self._client_gone(request)
            return resp
        finally:
            upstream.release()

    def _client_gone(self, request: web.Request) -> None:
        log.debug("client %s closed its connection before the response ended (%s)", request.remote, request.path)

    def _message(self, backend: Backend, exc: BaseException) -> str:
        if isinstance(exc, ProxyDown):
            return f"{self.down or backend.lost}; request to {backend.name} abandoned"
        cause = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if self.down is not None:
            return f"{self.down} (request to {backend.name} broken: {cause})"
        return f"{backend.name} failed: {cause}"

    def _failed(self, backend: Backend, exc: BaseException) -> web.Response:
        message = self._message(backend, exc)
        print(f"[proxy] 502: {message}", file=self.log, flush=True)
        return web.json_response(error_body(502, message), status=502)

    async def _failed_midway(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        backend: Backend,
        exc: BaseException,
    ) -> None:
        message = self._message(backend, exc)
        print(f"[proxy] broken response: {message}", file=self.log, flush=True)
        if upstream.content_type == "text/event-stream":
            event = f"data: {json.dumps(error_body(502, message))}\n\n"
            with contextlib.suppress(ConnectionError):
                await resp.write(event.encode())
                await resp.write_eof()
        elif request.transport is not None:  # a truncated body: close so the client sees it cut short
            request.transport.close()
