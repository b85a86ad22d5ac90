"""TGI's routes over the shared `Infer`: `/generate`, `/generate_stream`, `/`, `/tokenize`, `/health` and `/info`.

Their types are `router/api/tgi.py`; each route parses its body, validates it (`router/pipeline/`) and answers in
TGI's shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack

from aiohttp import web

from conveyor.router.api import tgi as api
from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.tgi import GenerateRequest
from conveyor.router.core.events import ErrorEvent, ScoredToken, TokenEvent
from conveyor.router.core.infer import Answer, Infer
from conveyor.router.frontends.adapter_routes import adapter_json
from conveyor.router.frontends.middleware import caller, holds_admin_key, request_id
from conveyor.router.frontends.replies import (
    REQUEST_ERRORS,
    AnswerDetails,
    details,
    error_event,
    error_response,
    full_text,
    json_error,
    logprob,
    open_sse,
    send_sse,
)
from conveyor.router.pipeline.request import ValidRequest, tgi_request
from conveyor.router.pipeline.validation import Validation
from conveyor.router.server_info import ServerInfo


def token_json(token: ScoredToken) -> api.Token:
    return {"id": token.id, "text": token.text, "logprob": logprob(token), "special": token.special}


def prefill_json(token: ScoredToken) -> api.Token:
    return {"id": token.id, "text": token.text, "logprob": logprob(token)}


def details_json(d: AnswerDetails) -> api.Details:
    body: api.Details = {
        "finish_reason": d.finish_reason,
        "generated_tokens": d.generated_tokens,
        "seed": d.seed,
        "prefill": [prefill_json(t) for t in d.prefill],
        "tokens": [token_json(t) for t in d.tokens],
    }
    if d.top_tokens is not None:
        body["top_tokens"] = [[token_json(t) for t in top] for top in d.top_tokens]
    body.update(cached_json(d))
    body.update(speculative_json(d))
    return body


def stream_details_json(d: AnswerDetails) -> api.StreamDetails:
    """A stream's last event: its tokens went out one by one, the prompt's length comes instead."""
    body: api.StreamDetails = {
        "finish_reason": d.finish_reason,
        "generated_tokens": d.generated_tokens,
        "seed": d.seed,
        "input_length": d.input_length,
    }
    body.update(cached_json(d))
    body.update(speculative_json(d))
    return body


def cached_json(d: AnswerDetails) -> api.CachedPrefill:
    """Present only for a request whose prompt the prefix cache served in part: an answer without a hit keeps
    TGI's shape exactly."""
    return {"prefill_cached_tokens": d.prefill_cached_tokens} if d.prefill_cached_tokens else {}


def speculative_json(d: AnswerDetails) -> api.Speculative:
    """Present only for a request that had drafts verified."""
    if not d.drafted_tokens:
        return {}
    return {
        "drafted_tokens": d.drafted_tokens,
        "accepted_tokens": d.accepted_tokens,
        "acceptance_rate": round(d.accepted_tokens / d.drafted_tokens, 4),
    }


class TgiRoutes:
    def __init__(self, infer: Infer, validation: Validation, info: ServerInfo, draining: Callable[[], bool]) -> None:
        self.infer = infer
        self.validation = validation
        self.info = info
        self.draining = draining  # whether the server is shutting down (health answers 503 then)

    def register(self, app: web.Application) -> None:
        app.router.add_post("/", self.compat)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/generate_stream", self.generate_stream)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.get_info)

    async def _validated(
        self, request: web.Request, stream: bool, stream_field: bool = True, generates: bool = True
    ) -> ValidRequest:
        """The body read and validated in the caller's turn on the validation threads. A request that would
        generate is first admitted (429 past the server's or its key's cap): refused work costs no tokenizing."""
        key = caller(request)
        if generates:
            self.infer.admit(key, 1)
        raw = await request.read()
        validation = self.validation

        def read() -> ValidRequest:
            return validation.validate(tgi_request(raw, stream=stream, stream_field=stream_field))

        return await validation.off_loop(read, owner=key.name)

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

    def _generate_json(self, valid: ValidRequest, response: Answer) -> api.GenerateResponse:
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
        if self.draining():  # a load balancer must stop sending here while in-flight requests finish
            return json_error(503, "server is shutting down", "unavailable")
        try:
            await self.infer.groups.health(timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            return json_error(503, f"unhealthy: {exc}", "healthcheck")
        healthy: api.Health = {"status": "ok"}
        return web.json_response(healthy)

    async def get_info(self, request: web.Request) -> web.Response:
        body = self.info.to_json()
        body.update(self.infer.groups.describe())
        adapters = self.infer.adapters
        with_source = holds_admin_key(request)
        body["lora_adapters"] = [adapter_json(a, with_source) for a in adapters.served.values()]
        body["max_loras"] = adapters.max_loras
        return web.json_response(body)
