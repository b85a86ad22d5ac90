"""The HTTP front end (aiohttp): TGI's routes and shapes over the shared `Infer`."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from conveyor.router import openapi
from conveyor.router.api import tgi as api
from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.tgi import GenerateRequest
from conveyor.router.connections import ConnectionLimits, body_deadline_middleware, refuse_large_expectations
from conveyor.router.dashboard import Dashboard
from conveyor.router.events import ErrorEvent, Token, TokenEvent
from conveyor.router.infer import Infer, Response
from conveyor.router.keys import ApiKey, KeyRing
from conveyor.router.middleware import (
    caller,
    draining_middleware,
    hide_server_version,
    json_body_middleware,
    json_errors_middleware,
    json_protocol_errors,
    key_middleware,
    request_id,
    send_request_id,
    trace_middleware,
)
from conveyor.router.openai import OpenAIRoutes
from conveyor.router.request import ValidRequest
from conveyor.router.request_control import RequestControl
from conveyor.router.responses import (
    REQUEST_ERRORS,
    UNAUTHORIZED,
    VALIDATION,
    Details,
    details,
    error_event,
    error_response,
    full_text,
    json_error,
    logprob,
    open_sse,
    send_sse,
)
from conveyor.router.validation import Limits, Validation

from conveyor import __version__

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerInfo:
    """What `/info` reports: the model, the engine and the limits in force."""

    model_id: str
    model_dtype: str
    engine: str
    limits: Limits
    max_concurrent_requests: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None
    num_shard: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    weight_bytes: int = 0  # rank 0's
    quantize: str | None = None
    device: str = "cpu"  # the shards' device type (the dashboard shows it)

    def to_json(self) -> api.Info:
        return {
            "model_id": self.model_id,
            "model_dtype": self.model_dtype,
            "engine": self.engine,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_input_tokens": self.limits.max_input_tokens,
            "max_total_tokens": self.limits.max_total_tokens,
            "max_stop_sequences": self.limits.max_stop_sequences,
            "max_top_n_tokens": self.limits.max_top_n_tokens,
            "max_batch_prefill_tokens": self.max_batch_prefill_tokens,
            "max_batch_total_tokens": self.max_batch_total_tokens,
            "max_batch_size": self.max_batch_size,
            "num_shard": self.num_shard,
            "generation_defaults": self.generation_defaults,
            "weight_bytes": self.weight_bytes,
            "quantize": self.quantize,
            "router": "conveyor",
            "version": __version__,
        }


# Refusals that never reach `Infer`, which counts the others (overloaded, generation) itself.
_UNQUEUED_REFUSALS = {VALIDATION.status: VALIDATION.error_type, UNAUTHORIZED.status: UNAUTHORIZED.error_type}


def token_json(token: Token) -> api.Token:
    return {"id": token.id, "text": token.text, "logprob": logprob(token), "special": token.special}


def prefill_json(token: Token) -> api.Token:
    return {"id": token.id, "text": token.text, "logprob": logprob(token)}


def details_json(d: Details) -> api.Details:
    body: api.Details = {
        "finish_reason": d.finish_reason,
        "generated_tokens": d.generated_tokens,
        "seed": d.seed,
        "prefill": [prefill_json(t) for t in d.prefill],
        "tokens": [token_json(t) for t in d.tokens],
    }
    if d.top_tokens is not None:
        body["top_tokens"] = [[token_json(t) for t in top] for top in d.top_tokens]
    body.update(speculative_json(d))
    return body


def stream_details_json(d: Details) -> api.StreamDetails:
    """A stream's last event: its tokens went out one by one, the prompt's length comes instead."""
    body: api.StreamDetails = {
        "finish_reason": d.finish_reason,
        "generated_tokens": d.generated_tokens,
        "seed": d.seed,
        "input_length": d.input_length,
    }
    body.update(speculative_json(d))
    return body


def speculative_json(d: Details) -> api.Speculative:
    """Present only for a request that had drafts verified."""
    if not d.drafted_tokens:
        return {}
    return {
        "drafted_tokens": d.drafted_tokens,
        "accepted_tokens": d.accepted_tokens,
        "acceptance_rate": round(d.accepted_tokens / d.drafted_tokens, 4),
    }


class HttpServer:
    def __init__(
        self,
        infer: Infer,
        validation: Validation,
        info: ServerInfo,
        keys: KeyRing | None = None,
        payload_limit: int = 2_000_000,
        connections: ConnectionLimits | None = None,
        metrics_key: str | None = None,
    ) -> None:
        # The metrics key as a ring of its own: one way to read and compare a `Bearer` credential.
        self.metrics_keys = KeyRing((ApiKey("metrics", metrics_key),)) if metrics_key else None
        self.infer = infer
        self.connections = connections or ConnectionLimits()
        self.validation = validation
        self.info = info
        self.keys = keys or KeyRing()
        self.payload_limit = payload_limit
        self.draining = False

    def app(self) -> web.Application:
        json_protocol_errors()
        app = web.Application(
            client_max_size=self.payload_limit,
            middlewares=[
                trace_middleware,
                self._count_refusals,
                json_errors_middleware,
                key_middleware(self.keys),
                draining_middleware(lambda: self.draining),
                body_deadline_middleware(self.connections.body_timeout),
                json_body_middleware,
            ],
        )
        app.on_response_prepare.append(send_request_id)
        app.on_response_prepare.append(hide_server_version)
        app.router.add_post("/", self.compat)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/generate_stream", self.generate_stream)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.get_info)
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get("/openapi.json", self.get_openapi)
        OpenAIRoutes(self.infer, self.validation, self.info.model_id).register(app)
        RequestControl(self.infer).register(app)
        Dashboard(self.infer, self.info).register(app)
        refuse_large_expectations(app, self.payload_limit)
        return app

    async def _validated(
        self, request: web.Request, stream: bool, stream_field: bool = True, generates: bool = True
    ) -> ValidRequest:
        """The body read and validated in the caller's turn on the validation threads. A request that would
        generate is first admitted (429 past the server's or its key's cap): refused work costs no tokenizing."""
        key = caller(request)
        if generates:
            self.infer.admit(key, 1)
        raw = await request.read()
        return await self.validation.off_loop(
            self.validation.validate, raw, stream=stream, stream_field=stream_field, owner=key.name
        )

    async def generate(self, request: web.Request, as_list: bool = False) -> web.Response:
        try:
            valid = await self._validated(request, stream=False, stream_field=as_list)
            response = await self.infer.generate(valid, caller(request), request_id(request))
        except REQUEST_ERRORS as exc:
            return error_response(exc)
        body = self._generate_json(valid, response)
        return web.json_response([body] if as_list else body)

    async def compat(self, request: web.Request) -> web.StreamResponse:
        """TGI's `POST /`: `stream` in the body picks streaming; the non-streaming answer is a one-item list.
        Hugging Face's `text-generation` client speaks only this route."""
        try:
            body = await self.validation.off_loop(
                parse, GenerateRequest, await request.read(), owner=caller(request).name
            )
        except ValidationError:
            body = None  # the route it goes to answers the error
        if body is not None and body.stream:
            return await self.generate_stream(request)
        return await self.generate(request, as_list=True)

    def _generate_json(self, valid: ValidRequest, response: Response) -> api.GenerateResponse:
        finished = response.finished
        body: api.GenerateResponse = {"generated_text": full_text(valid, finished.generated_text)}
        if valid.parameters.details:
            body["details"] = details_json(details(valid, finished, response.events, response.prefill))
        return body

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one per token; the last carries the text and details, or an error event."""
        async with AsyncExitStack() as stack:
            try:
                valid = await self._validated(request, stream=True)
                events = await stack.enter_async_context(self.infer.stream(valid, caller(request), request_id(request)))
            except REQUEST_ERRORS as exc:
                return error_response(exc)
            response = await open_sse(request, proxy_buffering=False)
            index = 0
            async for event in events:
                if isinstance(event, ErrorEvent):
                    await send_sse(response, error_event(event))
                    break
                index += 1
                await send_sse(response, self._stream_json(valid, event, index))
            return response

    def _stream_json(self, valid: ValidRequest, event: TokenEvent, index: int) -> api.StreamEvent:
        body: api.StreamEvent = {
            "index": index,
            "token": token_json(event.token),
            "generated_text": None,
            "details": None,
        }
        if valid.parameters.top_n_tokens:
            body["top_tokens"] = [token_json(t) for t in event.top_tokens]
        if event.finished is not None:
            body["generated_text"] = full_text(valid, event.finished.generated_text)
            if valid.parameters.details:
                body["details"] = stream_details_json(details(valid, event.finished))
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """TGI's /tokenize: the prompt's tokens as the server would see them, with character offsets."""
        try:
            valid = await self._validated(request, stream=False, generates=False)
        except REQUEST_ERRORS as exc:
            return error_response(exc)
        tokens = await self.validation.off_loop(self.validation.token_offsets, valid, owner=caller(request).name)
        offsets: list[api.TokenOffset] = [{"id": i, "text": t, "start": a, "stop": b} for i, t, a, b in tokens]
        return web.json_response(offsets)

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:  # a load balancer must stop sending here while in-flight requests finish
            return json_error(503, "server is shutting down", "unavailable")
        try:
            await self.infer.scheduler.client.health(timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            return json_error(503, f"unhealthy: {exc}", "healthcheck")
        if self.infer.scheduler.recovering:
            return json_error(503, "unhealthy: the shards are being restarted", "healthcheck")
        healthy: api.Health = {"status": "ok"}
        return web.json_response(healthy)

    @web.middleware
    async def _count_refusals(self, request: web.Request, handler) -> web.StreamResponse:
        """Requests refused before they reach the queue (the queue and streams count the rest)."""
        response = await handler(request)
        if (outcome := _UNQUEUED_REFUSALS.get(response.status)) is not None:
            self.infer.metrics.requests.labels(outcome).inc()
        return response

    async def get_openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document(__version__, self.info.limits))

    async def get_metrics(self, request: web.Request) -> web.Response:
        """Open, unless a --metrics-key is set: then that key or an admin key (the per-key figures name every
        tenant and show what each is doing)."""
        if self.metrics_keys is not None and not self._may_read_metrics(request.headers.get("Authorization", "")):
            return json_error(401, "GET /metrics needs the metrics key or an admin key: Bearer <key>", "unauthorized")
        body, content_type = self.infer.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _may_read_metrics(self, authorization: str) -> bool:
        assert self.metrics_keys is not None
        if self.metrics_keys.identify(authorization) is not None:
            return True
        key = self.keys.identify(authorization) if not self.keys.open else None
        return key is not None and key.admin

    async def get_info(self, request: web.Request) -> web.Response:
        body = self.info.to_json()
        body.update(self.infer.scheduler.describe())
        return web.json_response(body)
