"""The aiohttp middlewares every route shares: the trace of each generation call, the API key on generation
routes, and JSON bodies for the errors aiohttp raises itself (an oversized body, an unknown route), so that
every error has one shape."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from conveyor.router.responses import UNAUTHORIZED, authorized, json_error
from opentelemetry.trace import SpanKind

from conveyor import tracing

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


@web.middleware
async def trace_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """POST calls get a server span, continuing the caller's trace when a W3C `traceparent` header came in."""
    if request.method != "POST":
        return await handler(request)
    parent = tracing.extract(request.headers)
    with tracing.span(f"POST {request.path}", parent, kind=SpanKind.SERVER) as span:
        response = await handler(request)
        span.set_attribute("http.status_code", response.status)
        return response


def api_key_middleware(api_key: str | None) -> Middleware:
    """POST routes (generation, tokenization) need `Authorization: Bearer <key>`; GET routes (health, info,
    metrics, models, the OpenAPI document) stay open for probes and scrapers."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and not authorized(request.headers.get("Authorization", ""), api_key):
            message = "a valid API key is required: Authorization: Bearer <key>"
            return json_error(UNAUTHORIZED.status, message, UNAUTHORIZED.error_type)
        return await handler(request)

    return middleware


@web.middleware
async def json_errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        return json_error(413, f"request body too large: {exc.text}", "payload_too_large")
    except web.HTTPNotFound:
        return json_error(404, f"no route {request.method} {request.path}", "not_found")
    except web.HTTPMethodNotAllowed:
        return json_error(405, f"{request.method} is not allowed on {request.path}", "method_not_allowed")
    except web.HTTPException:
        raise
    except Exception:  # a bug, never the client's fault: still one JSON shape, and the trace in the log
        log.exception("unhandled error", extra={"path": request.path})
        return json_error(500, "internal error", "internal")
