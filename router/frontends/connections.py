"""What a client may hold open without sending work: the HTTP server's limits on slow and idle connections.

aiohttp reads headers and bodies for as long as a client takes: connections that sent their headers a byte at
a time, or a body slower than its Content-Length, stayed open indefinitely (no key needed), and
`Expect: 100-continue` with a 50 MB Content-Length was told to go ahead. Here:

- `idle_timeout`: a connection that has not sent a whole request's headers within this many seconds of opening
  (or of its last answer, when kept alive) is closed. aiohttp's keep-alive timer already runs from the moment a
  connection opens and closes it if no request has arrived; it is that timer, set from this limit.
- `body_timeout`: a request's body must arrive within this many seconds of its headers (408 otherwise), read by
  `body_deadline_middleware` before any handler.
- `Expect: 100-continue` is answered 401 when the request needs a key it does not carry, and 413 when the announced
  Content-Length is over the payload limit, before anything invites the body.
- A body announced over the payload limit without `Expect` is answered 413 at once, not read until the body timeout.
- `max_per_client`: connections one client address may hold open at once; past it a new one is closed at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler

from conveyor.router.frontends.replies import json_error

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 15.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_MAX_PER_CLIENT = 256


@dataclass(frozen=True)
class ConnectionLimits:
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_per_client: int = DEFAULT_MAX_PER_CLIENT

    def runner_options(self) -> dict[str, float]:
        """aiohttp's own options that carry these limits (its keep-alive timer closes idle and slow-header
        connections)."""
        return {"keepalive_timeout": self.idle_timeout}


def expect_within(limit: int, refuse: Callable[[web.Request], web.StreamResponse | None]):
    """An `Expect` handler that refuses, before the client sends it, a body `refuse` turns away (a request without
    the key it needs) or one over `limit` bytes (413), instead of inviting it with `100 Continue`."""

    async def handler(request: web.Request) -> web.StreamResponse | None:
        expect = request.headers.get(hdrs.EXPECT, "").lower()
        if expect != "100-continue":
            return json_error(417, f"unknown Expect: {expect[:64]!r}", "bad_request")
        refused = refuse(request) or too_large(request, limit)
        if refused is not None:
            refused.force_close()  # the body it would have sent is not read
            return refused
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer's own bytes come after: it has not started yet
        return None

    return handler


def too_large(request: web.Request, limit: int) -> web.Response | None:
    """A 413 for a body announced over `limit` bytes."""
    if request.content_length is None or request.content_length <= limit:
        return None
    return json_error(413, f"the body would be {request.content_length} bytes, over {limit}", "payload_too_large")


def refuse_large_expectations(
    app: web.Application, limit: int, refuse: Callable[[web.Request], web.StreamResponse | None]
) -> None:
    """Installs `expect_within(limit, refuse)` on every route of `app` (aiohttp runs a route's Expect handler
    before any middleware, and has no application-wide setting for it)."""
    handler = expect_within(limit, refuse)
    for route in app.router.routes():
        route._expect_handler = handler  # noqa: SLF001 - set per route at add_route, which the routes did not get


def body_deadline_middleware(seconds: float, limit: int):
    """Reads every request body within `seconds` of its headers (handlers then read it from memory): a body
    slower than that is answered 408 and the connection closed, one announced over `limit` bytes 413 at once."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        refused = too_large(request, limit)
        if refused is not None:
            refused.force_close()
            return refused
        if request.body_exists:
            try:
                await asyncio.wait_for(request.read(), seconds)
            except asyncio.TimeoutError:
                response = json_error(408, f"the request body did not arrive within {seconds:g} s", "timeout")
                response.force_close()
                return response
            except ConnectionResetError:  # the client went away mid-body: nobody to answer, nothing to log loudly
                log.info("client reset the connection before its body arrived", extra={"path": request.path})
                response = json_error(400, "the connection was reset before the body arrived", "bad_request")
                response.force_close()
                return response
        return await handler(request)

    return middleware


class ClientCap:
    """Counts each client address's open connections on aiohttp's server, closing a new one past the cap."""

    def __init__(self, server: web.Server, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self.open: Counter[str] = Counter()
        self._hosts: dict[RequestHandler, str] = {}
        self._made, self._lost = server.connection_made, server.connection_lost
        server.connection_made = self.connection_made  # type: ignore[method-assign]
        server.connection_lost = self.connection_lost  # type: ignore[method-assign]

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        self._made(handler, transport)
        host = self._hosts[handler] = _host(transport)
        self.open[host] += 1
        if self.open[host] > self.max_per_client:
            log.warning("too many connections from one client", extra={"client": host, "cap": self.max_per_client})
            handler.force_close()
            transport.close()

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._lost(handler, exc)
        host = self._hosts.pop(handler, None)
        if host is not None:
            self.open[host] -= 1
            if not self.open[host]:
                del self.open[host]


def _host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""
