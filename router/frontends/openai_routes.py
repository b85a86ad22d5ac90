"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Each route maps OpenAI's fields onto TGI's parameter names and goes through the same validation, queue and
scheduler as `/generate`. `n` choices are `n` requests run side by side. Errors use OpenAI's shape (with
`error_type` beside it, as every Conveyor error has). The bodies are read into requests by
`pipeline/openai_requests.py`, and the answers shaped by `openai_format.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

from aiohttp import web

from conveyor.router.api import openai as api
from conveyor.router.api.base import parse
from conveyor.router.api.openai import ChatRequest, CompletionRequest, OpenAIRequest
from conveyor.router.core.events import ErrorEvent
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.middleware import caller, holds_admin_key, request_id
from conveyor.router.frontends.openai_format import ChatFormat, CompletionFormat, Format, usage
from conveyor.router.frontends.replies import REQUEST_ERRORS, error_event, error_response, open_sse, send_sse
from conveyor.router.pipeline.openai_requests import Choice, OpenAIRequests


class OpenAIRoutes:
    def __init__(self, infer: Infer, requests: OpenAIRequests, model_id: str) -> None:
        self.infer = infer
        self.requests = requests
        self.validation = requests.validation
        self.model_id = model_id
        self.created = int(time.time())

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)

    async def models(self, request: web.Request) -> web.Response:
        """The base model, then each LoRA adapter served (vLLM's shape: `parent` names the base model). `root`, the
        adapter's source, is a path on the shards' machines: only an admin key's answer has it (the route is open)."""
        model: api.ModelCard = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "conveyor"}
        with_source = holds_admin_key(request)
        adapters: list[api.ModelCard] = [
            {**model, "id": a.name, "parent": self.model_id, **({"root": a.source} if with_source else {})}
            for a in self.infer.adapters.served.values()
        ]
        models: api.Models = {"object": "list", "data": [model, *adapters]}
        return web.json_response(models)

    # --- handlers -----------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        fmt = CompletionFormat(self.model_id)
        return await self._handle(request, CompletionRequest, self.requests.completion_choices, fmt)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, ChatRequest, self.requests.chat_choices, ChatFormat(self.model_id))

    async def _handle(
        self, request: web.Request, model: type[OpenAIRequest], choices_of: Callable, fmt: Format
    ) -> web.StreamResponse:
        def read(raw: bytes) -> tuple[OpenAIRequest, list[Choice]]:
            body = parse(model, raw)
            return body, choices_of(body)

        key = caller(request)
        try:
            self.infer.admit(key, 1)  # refused work costs no tokenizing; the choices are counted once known
            body, choices = await self.validation.off_loop(read, await request.read(), owner=key.name)
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        wants_logprobs = any(c.request.parameters.top_n_tokens for c in choices)
        try:
            self.infer.admit(key, len(choices))  # all the choices or none: a 429 leaves nothing running
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage is True
            return await self._stream(request, choices, fmt, usage, wants_logprobs)
        name = request_id(request)
        tasks = [asyncio.ensure_future(self.infer.generate(c.request, key, name)) for c in choices]
        try:
            responses = await asyncio.gather(*tasks)
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        finally:
            for task in tasks:  # a failed choice ends its siblings at once (and frees their blocks)
                task.cancel()
        answer = fmt.response([(c, r) for c, r in zip(choices, responses)], wants_logprobs)
        return web.json_response(answer)

    async def _stream(
        self, request: web.Request, choices: list[Choice], fmt: Format, include_usage: bool, logprobs: bool
    ) -> web.StreamResponse:
        async with AsyncExitStack() as stack:
            try:
                key, name = caller(request), request_id(request)
                streams = [await stack.enter_async_context(self.infer.stream(c.request, key, name)) for c in choices]
            except REQUEST_ERRORS as exc:
                return error_response(exc, openai=True)
            response = await open_sse(request)
            for chunk in fmt.opening(choices):
                await send_sse(response, chunk)
            completion_tokens = cached_tokens = 0
            async for choice, event in _merge(choices, streams):
                if isinstance(event, ErrorEvent):
                    await send_sse(response, error_event(event, openai=True))
                    break
                completion_tokens += 1
                cached_tokens += event.finished.cached_tokens if event.finished is not None else 0
                await send_sse(response, fmt.chunk(choice, event, logprobs))
            else:
                if include_usage:
                    prompt_tokens = sum(len(c.request.input_ids) for c in choices)
                    await send_sse(response, fmt.usage_chunk(usage(prompt_tokens, completion_tokens, cached_tokens)))
                await response.write(b"data: [DONE]\n\n")
            return response


async def _merge(choices: list[Choice], streams: list[AsyncIterator]) -> AsyncIterator[tuple[Choice, Any]]:
    """Interleaves the choices' events in the order they arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice, events: AsyncIterator) -> None:
        async for event in events:
            await queue.put((choice, event))
        await queue.put((choice, None))

    tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(choices, streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            choice, event = await queue.get()
            if event is None:
                open_streams -= 1
                continue
            yield choice, event
            if isinstance(event, ErrorEvent):
                return
    finally:
        for task in tasks:
            task.cancel()
