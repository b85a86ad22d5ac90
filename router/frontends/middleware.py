"""The aiohttp middlewares every route shares: the trace of each generation call, the API key (which tenant
calls: `Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`) and the request's id, the JSON
Content-Type of request bodies, and JSON bodies for the errors aiohttp raises itself (an oversized body, an unknown
route, a body that does not decompress, a request it cannot even parse), so that every error has one shape: the
route's API's (`shaped_error`)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from opentelemetry.trace import SpanKind

from conveyor import tracing
from conveyor.keys import ApiKey, KeyRing
from conveyor.router.frontends.replies import UNAUTHORIZED, anthropic_error, error_body, json_error

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


# GET routes that show requests or their owners: behind the API key like every POST and DELETE route. The other
# GET routes (health, info, metrics, models, the OpenAPI document, the dashboard's page) stay open for probes and
# scrapers; the dashboard's page reads its figures from /dashboard/state.
PRIVATE_GETS = frozenset({"/v1/requests", "/dashboard/state"})
PRIVATE_PREFIXES = ("/v1/responses/",)  # a stored response is its key's
REQUEST_ID = re.compile(r"[A-Za-z0-9._:~-]{1,128}")


def name_request(given: str) -> str:
    """A request's id, sent back to its caller and used to cancel it: the caller's own (`X-Request-Id`, gRPC's
    `x-request-id`) if it is a safe token (at most 128 letters, digits or `._:~-`), else a new one."""
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def request_id(request: web.Request) -> str:
    if "request_id" not in request:
        request["request_id"] = name_request(request.headers.get("X-Request-Id", ""))
    return request["request_id"]


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries `X-Request-Id`, streams (whose headers leave before the handler ends) and errors
    included: an `on_response_prepare` signal, not a middleware."""
    response.headers["X-Request-Id"] = request_id(request)


SERVER = "conveyor"  # the `Server` header of every answer


async def hide_server_version(request: web.Request, response: web.StreamResponse) -> None:
    """`Server: conveyor` instead of aiohttp's Python and aiohttp versions, which tell a scanner what to try."""
    response.headers["Server"] = SERVER


def caller(request: web.Request) -> ApiKey:
    """The key a request came with (`key_middleware` checked it)."""
    return request["key"]


def holds_admin_key(request: web.Request) -> bool:
    """Whether the request came with an admin key. An open GET route runs for callers with no key or a wrong one
    (no `caller` then), and on an open server nobody holds one: the anonymous caller may manage everything, but what
    only an admin key may read on an open route (where adapters live on disk) is shown to no one there."""
    key: ApiKey | None = request.get("key")
    return key is not None and key.admin and key.secret is not None


def refuse_non_admin(request: web.Request) -> web.Response | None:
    """A 403 for a route that changes what every tenant gets (adapters served, shard groups in placement): an admin
    key's to change (on an open server, everyone is the anonymous admin, as for cancelling any request)."""
    if caller(request).admin:
        return None
    return json_error(403, f"{request.path} needs an admin API key", "forbidden")


def credential(request: web.Request) -> str:
    """The key a request presents, as an `Authorization` value: that header, or else Anthropic's `x-api-key`
    (what Anthropic's SDKs and Claude Code send)."""
    authorization = request.headers.get("Authorization")
    if authorization is None and (api_key := request.headers.get("x-api-key")) is not None:
        return f"Bearer {api_key}"
    return authorization or ""


def key_middleware(keys: KeyRing) -> Middleware:
    """Which API key calls (`credential`), for POST and DELETE routes and `PRIVATE_GETS`; an open server (no key)
    lets everyone in as "anonymous"."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = keys.identify(credential(request))
        if key is None and needs_key(request):
            return key_required(request)
        request["key"] = key
        return await handler(request)

    return middleware


def refuse_without_key(keys: KeyRing) -> Callable[[web.Request], web.Response | None]:
    """`key_middleware`'s refusal alone, for the `Expect: 100-continue` handler, which runs before any middleware."""

    def refuse(request: web.Request) -> web.Response | None:
        missing = needs_key(request) and keys.identify(credential(request)) is None
        return key_required(request) if missing else None

    return refuse


def needs_key(request: web.Request) -> bool:
    """POST and DELETE routes and `PRIVATE_GETS` take a key; other GETs are open."""
    private = request.path in PRIVATE_GETS or request.path.startswith(PRIVATE_PREFIXES)
    return request.method in ("POST", "DELETE") or private


def key_required(request: web.Request) -> web.Response:
    message = "a valid API key is required: Authorization: Bearer <key>, or x-api-key: <key>"
    return shaped_error(request, UNAUTHORIZED.status, message, UNAUTHORIZED.error_type)


def draining_middleware(draining: Callable[[], bool]) -> Middleware:
    """During a drain every POST route, TGI's and OpenAI's, refuses new work (503 `unavailable`), so that the
    requests in flight are the last; GET routes still answer (`/health` with its own 503)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and draining():
            return shaped_error(request, 503, "server is shutting down", "unavailable")
        return await handler(request)

    return middleware


def _openai(request: web.Request) -> bool:
    """OpenAI's routes answer errors in OpenAI's shape (with `error_type` beside it)."""
    return request.path.startswith("/v1/")


ANTHROPIC_PATH = "/v1/messages"  # Anthropic's routes: /v1/messages and what is under it


def anthropic_route(request: web.Request) -> bool:
    return request.path == ANTHROPIC_PATH or request.path.startswith(ANTHROPIC_PATH + "/")


def shaped_error(request: web.Request, status: int, message: str, error_type: str) -> web.Response:
    """An error in the shape of the route's API: Anthropic's on its routes, OpenAI's on the other `/v1/` routes,
    Conveyor's elsewhere."""
    if anthropic_route(request):
        return anthropic_error(status, message, error_type)
    return json_error(status, message, error_type, openai=_openai(request))


@web.middleware
async def json_body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every POST body is JSON: a body declared as something else (text/plain, a form) is refused with 415
    rather than parsed as JSON anyway. A body with no Content-Type at all is read as JSON, as TGI's clients and
    `curl --data-binary` without a header expect."""
    declared = request.headers.get("Content-Type")
    if request.method == "POST" and declared is not None and not _is_json(declared):
        message = f"Content-Type must be application/json (with charset utf-8, if any). Given: {declared[:100]}"
        return shaped_error(request, 415, message, "unsupported_media_type")
    return await handler(request)


def _is_json(content_type: str) -> bool:
    mime, *params = (part.strip().lower() for part in content_type.split(";"))
    if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
        return False
    charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
    return all(charset in ("utf-8", "utf8") for charset in charsets)


@web.middleware
async def json_errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    def error(status: int, message: str, error_type: str) -> web.Response:
        return shaped_error(request, status, message, error_type)

    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        return error(413, f"request body too large: {exc.text}", "payload_too_large")
    except web.HTTPNotFound:
        return error(404, f"no route {request.method} {request.path}", "not_found")
    except web.HTTPMethodNotAllowed as exc:
        response = error(405, f"{request.method} is not allowed on {request.path}", "method_not_allowed")
        response.headers["Allow"] = exc.headers.get("Allow", "")
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error(exc.status, exc.text or exc.reason, "bad_request" if exc.status < 500 else "internal")
    except (RequestPayloadError, HttpProcessingError) as exc:  # a body that does not decode (bad gzip), a bad chunk
        cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
        message = cause.message if isinstance(cause, HttpProcessingError) else str(cause)
        return error(400, f"the request body could not be read: {message}", "bad_request")
    except Exception:  # a bug, never the client's fault: still one JSON shape, and the trace in the log
        log.exception("unhandled error", extra={"path": request.path})
        return error(500, "internal error", "internal")


def unquoted_reason(message: str | None) -> str:
    """aiohttp's parse error without the bytes it quotes: those are the client's header line, Authorization
    included, which must not be echoed back nor logged (the answer and router/frontends/malformed.py's log line
    keep this reason; conveyor.log.redact catches a credential that anything else quotes)."""
    lines = (message or "").strip().splitlines()
    first = lines[0] if lines else ""
    return re.split(r":?\s*(?:bytearray\()?b['\"]", first, maxsplit=1)[0].rstrip(": ")


def json_protocol_errors() -> None:
    """Makes the answers aiohttp gives before any route or middleware runs JSON as well: a request it cannot
    parse (a header line over 8190 bytes, more than 128 headers, a malformed request line, chunk or length, a
    Content-Encoding it cannot decode) gets a 400 with `{"error", "error_type": "bad_request"}` instead of
    text/plain. aiohttp has no setting for this, so its `RequestHandler.handle_error` is wrapped (once, for
    this process): the status, the logging and the closing of the connection stay aiohttp's."""
    original = RequestHandler.handle_error
    if getattr(original, "conveyor_json", False):
        return

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        response = original(self, request, status, exc, message)
        if status < 500:
            body = error_body(unquoted_reason(message) or response.reason, "bad_request")
        else:
            body = error_body("internal error" if status == 500 else response.reason, "internal")
        json_response = web.json_response(body, status=status, headers={"Server": SERVER})
        json_response.force_close()
        return json_response

    handle_error.conveyor_json = True  # type: ignore[attr-defined]
    RequestHandler.handle_error = handle_error  # type: ignore[method-assign]
