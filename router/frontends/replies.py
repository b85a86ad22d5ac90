"""What the front doors (TGI's HTTP routes, the OpenAI routes, gRPC) answer, written once so that they cannot
drift apart: the status each of the router's errors gets, the JSON error body, a finished generation's details,
and server-sent events."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from conveyor.router.api.base import ValidationError
from conveyor.router.core.adapter_registry import AdapterConflict, AdapterLoadError
from conveyor.router.core.events import ErrorEvent, Finished, ScoredToken, TokenEvent
from conveyor.router.core.infer import GenerationError, OverloadedError, RequestCancelled, UnavailableError
from conveyor.router.pipeline.request import ValidRequest
from conveyor.router.pipeline.validation import UnknownAdapter


@dataclass(frozen=True)
class Failure:
    """One kind of failed request as each protocol reports it. `error_type` is also the outcome a refusal is
    counted under in `conveyor_requests_total`, so bodies and metrics use the same words."""

    status: int
    error_type: str
    grpc_code: grpc.StatusCode
    openai_type: str = "server_error"  # the `type` of OpenAI's error object, which OpenAI's clients read


VALIDATION = Failure(422, "validation", grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")
OVERLOADED = Failure(429, "overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded_error")
GENERATION = Failure(424, "generation", grpc.StatusCode.UNAVAILABLE)
UNAUTHORIZED = Failure(401, "unauthorized", grpc.StatusCode.UNAUTHENTICATED)
UNAVAILABLE = Failure(503, "unavailable", grpc.StatusCode.UNAVAILABLE)
# Cancelled by its id: 499, the status Google's API design maps gRPC's CANCELLED to (nginx's "client closed").
CANCELLED = Failure(499, "cancelled", grpc.StatusCode.CANCELLED, "cancelled")
# LoRA adapters: a name not served; a load or unload that clashes with what is served; files that do not fit.
NOT_FOUND = Failure(404, "not_found", grpc.StatusCode.NOT_FOUND, "invalid_request_error")
CONFLICT = Failure(409, "conflict", grpc.StatusCode.FAILED_PRECONDITION, "invalid_request_error")
BAD_ADAPTER = Failure(400, "invalid_adapter", grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")

# The first kind an error is decides: UnknownAdapter is a kind of ValidationError.
_FAILURES: dict[type[Exception], Failure] = {
    UnknownAdapter: NOT_FOUND,
    ValidationError: VALIDATION,
    OverloadedError: OVERLOADED,
    GenerationError: GENERATION,
    UnavailableError: UNAVAILABLE,
    RequestCancelled: CANCELLED,
    AdapterConflict: CONFLICT,
    AdapterLoadError: BAD_ADAPTER,
}
REQUEST_ERRORS = tuple(_FAILURES)  # what validating, queueing or generating a request can raise


def failure_of(exc: Exception) -> Failure:
    return next(failure for kind, failure in _FAILURES.items() if isinstance(exc, kind))


def failure_named(error_type: str) -> Failure:
    """The failure a stream's error event names (`cancelled`, `unavailable`; a failed generation otherwise)."""
    return next((f for f in _FAILURES.values() if f.error_type == error_type), GENERATION)


# --- JSON errors ------------------------------------------------------------------------------------------


def error_body(error: str | dict[str, Any], error_type: str) -> dict[str, Any]:
    """Every error Conveyor sends, as a response or as a stream's last event, has `error_type` beside `error`."""
    return {"error": error, "error_type": error_type}


def json_error(status: int, message: str, error_type: str, openai: bool = False) -> web.Response:
    """With `openai`, `error` is OpenAI's error object, as OpenAI's clients expect on its routes."""
    error: str | dict[str, Any] = message
    if openai:
        error = openai_error(message, "invalid_request_error" if status < 500 else "server_error")
    return web.json_response(error_body(error, error_type), status=status)


def openai_error(message: str, kind: str) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": None, "code": None}


def error_response(exc: Exception, openai: bool = False) -> web.Response:
    """The answer to one of `REQUEST_ERRORS`, in OpenAI's shape on its routes (`openai`)."""
    failure = failure_of(exc)
    error: str | dict[str, Any] = openai_error(str(exc), failure.openai_type) if openai else str(exc)
    return web.json_response(error_body(error, failure.error_type), status=failure.status)


# Anthropic's error types by status: a 4xx it does not list is an invalid_request_error, a 5xx an api_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    424: "api_error",  # a generation that failed: the server's fault, not the request's
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str, error_type: str) -> web.Response:
    """An error in Anthropic's shape, `error_type` beside it. Anthropic answers an invalid request 400, not 422;
    the answer remembers `error_type` (`response["error_type"]`) so that refusals are counted as on every route."""
    status = 400 if status == VALIDATION.status else status
    body = {"type": "error", "error": anthropic_error_detail(status, message), "error_type": error_type}
    response = web.json_response(body, status=status)
    response["error_type"] = error_type
    return response


def anthropic_error_detail(status: int, message: str) -> dict[str, str]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": kind, "message": message}


def anthropic_error_response(exc: Exception) -> web.Response:
    """The answer to one of `REQUEST_ERRORS` on Anthropic's routes."""
    failure = failure_of(exc)
    return anthropic_error(failure.status, str(exc), failure.error_type)


def error_event(event: ErrorEvent, openai: bool = False) -> dict[str, Any]:
    """The last event of a stream that failed after its 200 went out, so the error can only travel in the body."""
    error = {"message": event.message, "type": GENERATION.openai_type} if openai else event.message
    return error_body(error, event.error_type)


# --- a finished generation ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerDetails:
    """A finished generation's details as plain values; HTTP shapes them as JSON, gRPC as its message."""

    finish_reason: str
    generated_tokens: int
    seed: int | None
    input_length: int
    prefill: tuple[ScoredToken, ...] = ()
    tokens: tuple[ScoredToken, ...] = ()
    # Per token; None unless `top_n_tokens` asked for them.
    top_tokens: tuple[tuple[ScoredToken, ...], ...] | None = None
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    accepted_tokens: int = 0
    prefill_cached_tokens: int = 0  # prompt tokens served from the prefix cache (memory or disk), not computed


def details(
    valid: ValidRequest, finished: Finished, events: Sequence[TokenEvent] = (), prefill: Sequence[ScoredToken] = ()
) -> AnswerDetails:
    """A stream's last event passes no `events`: its tokens went out one by one already."""
    return AnswerDetails(
        finish_reason=finished.finish_reason,
        generated_tokens=finished.generated_tokens,
        seed=finished.seed,
        input_length=len(valid.input_ids),
        prefill=tuple(prefill),
        tokens=tuple(e.token for e in events),
        top_tokens=tuple(e.top_tokens for e in events) if valid.parameters.top_n_tokens else None,
        drafted_tokens=finished.drafted_tokens,
        accepted_tokens=finished.accepted_tokens,
        prefill_cached_tokens=finished.cached_tokens,
    )


def full_text(valid: ValidRequest, text: str) -> str:
    return valid.inputs + text if valid.parameters.return_full_text else text


def logprob(token: ScoredToken) -> float | None:
    """The first prompt token has no log-probability (NaN inside the router), and an alternative a warper ruled
    out (top-k, top-p) has -inf, which JSON cannot carry: both protocols send none, as TGI does (null)."""
    return token.logprob if math.isfinite(token.logprob) else None


OPENAI_MIN_LOGPROB = -9999.0


def openai_logprob(token: ScoredToken) -> float:
    """OpenAI's routes always carry a number: an impossible token's -inf is -9999.0, as OpenAI and vLLM send."""
    return token.logprob if token.logprob >= OPENAI_MIN_LOGPROB else OPENAI_MIN_LOGPROB


# --- server-sent events -------------------------------------------------------------------------------------

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def open_sse(request: web.Request, proxy_buffering: bool = True) -> web.StreamResponse:
    """Sends the headers of an event stream. Without `proxy_buffering`, `X-Accel-Buffering: no` asks a proxy in
    front (nginx) to pass each event on at once instead of collecting them."""
    headers = SSE_HEADERS if proxy_buffering else {**SSE_HEADERS, "X-Accel-Buffering": "no"}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, payload: dict[str, Any], event: str | None = None) -> None:
    """One event; `event` names it on an `event:` line (Anthropic's and the Responses API's streams)."""
    named = f"event: {event}\n".encode() if event is not None else b""
    await response.write(named + b"data: " + json.dumps(payload).encode() + b"\n\n")


def token_text(event: TokenEvent) -> str:
    """A streamed token's text; the special token that ended the output is not part of it (as in the answer's
    whole text), though its logprob entry still names it."""
    ended = event.finished is not None and event.finished.finish_reason == "eos_token"
    return "" if ended and event.token.special else event.token.text
