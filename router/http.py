"""The HTTP front end (aiohttp): TGI's routes and shapes over the shared `Infer`."""

from __future__ import annotations

import json
import logging
import math
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from conveyor import __version__
from conveyor.router.auth import api_key_middleware, json_errors_middleware, trace_middleware
from conveyor.router.events import ErrorEvent, Token, TokenEvent
from conveyor.router.infer import GenerationError, Infer, OverloadedError, Response
from conveyor.router import openapi
from conveyor.router.openai import OpenAIRoutes
from conveyor.router.validation import Limits, ValidationError, Validation, ValidRequest

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
    waiting_served_ratio: float
    max_waiting_tokens: int
    num_shard: int

    def to_json(self) -> dict[str, Any]:
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
            "waiting_served_ratio": self.waiting_served_ratio,
            "max_waiting_tokens": self.max_waiting_tokens,
            "num_shard": self.num_shard,
            "router": "conveyor",
            "version": __version__,
        }


def error(status: int, message: str, error_type: str) -> web.Response:
    return web.json_response({"error": message, "error_type": error_type}, status=status)


def _float(x: float) -> float | None:
    """JSON has no NaN: a missing logprob (the first prompt token's) is null."""
    return None if math.isnan(x) else x


def token_json(token: Token) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": _float(token.logprob), "special": token.special}


def prefill_json(token: Token) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": _float(token.logprob)}


def full_text(request: ValidRequest, text: str) -> str:
    return request.inputs + text if request.parameters.return_full_text else text


class HttpServer:
    def __init__(
        self, infer: Infer, validation: Validation, info: ServerInfo, api_key: str | None = None,
        payload_limit: int = 2_000_000,
    ) -> None:  # fmt: skip
        self.infer = infer
        self.validation = validation
        self.info = info
        self.api_key = api_key
        self.payload_limit = payload_limit
        self.draining = False

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.payload_limit,
            middlewares=[
                trace_middleware, self._count_refusals, json_errors_middleware, api_key_middleware(self.api_key)
            ],
        )
        app.router.add_post("/", self.compat)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/generate_stream", self.generate_stream)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.get_info)
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get("/openapi.json", self.get_openapi)
        OpenAIRoutes(self.infer, self.validation, self.info.model_id).register(app)
        return app

    async def _validated(self, request: web.Request, stream: bool) -> ValidRequest:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValidationError(f"request body is not valid JSON: {exc}") from None
        return self.validation.validate(body, stream=stream)

    async def generate(self, request: web.Request, as_list: bool = False) -> web.Response:
        if self.draining:
            return error(503, "server is shutting down", "unavailable")
        try:
            valid = await self._validated(request, stream=False)
            response = await self.infer.generate(valid)
        except ValidationError as exc:
            return error(422, str(exc), "validation")
        except OverloadedError as exc:
            return error(429, str(exc), "overloaded")
        except GenerationError as exc:
            return error(424, str(exc), "generation")
        body = self._generate_json(valid, response)
        return web.json_response([body] if as_list else body)

    async def compat(self, request: web.Request) -> web.StreamResponse:
        """TGI's `POST /`: `stream` in the body picks streaming; the non-streaming answer is a one-item list.
        Hugging Face's `text-generation` client speaks only this route."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if isinstance(body, dict) and body.get("stream") is True:
            return await self.generate_stream(request)
        return await self.generate(request, as_list=True)

    def _generate_json(self, valid: ValidRequest, response: Response) -> dict[str, Any]:
        finished = response.finished
        body: dict[str, Any] = {"generated_text": full_text(valid, finished.generated_text)}
        if valid.parameters.details:
            body["details"] = {
                "finish_reason": finished.finish_reason,
                "generated_tokens": finished.generated_tokens,
                "seed": finished.seed,
                "prefill": [prefill_json(t) for t in response.prefill],
                "tokens": [token_json(t) for t in response.tokens],
            }
            if valid.parameters.top_n_tokens:
                body["details"]["top_tokens"] = [[token_json(t) for t in e.top_tokens] for e in response.events]
        return body

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one per token; the last carries the text and details, or an error event."""
        if self.draining:
            return error(503, "server is shutting down", "unavailable")
        async with AsyncExitStack() as stack:
            try:
                valid = await self._validated(request, stream=True)
                events = await stack.enter_async_context(self.infer.stream(valid))
            except ValidationError as exc:
                return error(422, str(exc), "validation")
            except OverloadedError as exc:
                return error(429, str(exc), "overloaded")
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
            await response.prepare(request)
            index = 0
            async for event in events:
                if isinstance(event, ErrorEvent):
                    await _send_sse(response, {"error": event.message, "error_type": event.error_type})
                    break
                index += 1
                await _send_sse(response, self._stream_json(valid, event, index))
            return response

    def _stream_json(self, valid: ValidRequest, event: TokenEvent, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
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
                body["details"] = {
                    "finish_reason": event.finished.finish_reason,
                    "generated_tokens": event.finished.generated_tokens,
                    "seed": event.finished.seed,
                    "input_length": len(valid.input_ids),
                }
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """TGI's /tokenize: the prompt's tokens as the server would see them, with character offsets."""
        try:
            valid = await self._validated(request, stream=False)
        except ValidationError as exc:
            return error(422, str(exc), "validation")
        tokens = self.validation.token_offsets(valid)
        return web.json_response([dict(zip(("id", "text", "start", "stop"), t)) for t in tokens])

    async def health(self, request: web.Request) -> web.Response:
        try:
            await self.infer.scheduler.client.health(timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            return error(503, f"unhealthy: {exc}", "healthcheck")
        if not self.infer.scheduler.healthy:
            return error(503, "unhealthy: a generation step failed", "healthcheck")
        return web.json_response({"status": "ok"})

    @web.middleware
    async def _count_refusals(self, request: web.Request, handler) -> web.StreamResponse:
        """Requests refused before they reach the queue (the queue and streams count the rest)."""
        response = await handler(request)
        if (outcome := {422: "validation", 401: "unauthorized"}.get(response.status)) is not None:
            self.infer.metrics.requests.labels(outcome).inc()
        return response

    async def get_openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document(__version__))

    async def get_metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.infer.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def get_info(self, request: web.Request) -> web.Response:
        body = self.info.to_json()
        body.update(self.infer.scheduler.describe())
        allocator = self.infer.scheduler.allocator
        if allocator is not None:  # paged engine: KV use in blocks, live (free counts evictable cached blocks)
            body.update(block_size=allocator.block_size, kv_blocks_total=allocator.num_blocks,
                        kv_blocks_free=allocator.free_blocks, kv_blocks_cached=allocator.cached_blocks)  # fmt: skip
        return web.json_response(body)


async def _send_sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
