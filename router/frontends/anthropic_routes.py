"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request is translated into the chat it is (`chat_body`) and goes through the chat route's own steps
(template, tools, the forced call's grammar, reasoning, the one validation), as the Responses API's does: a tool
call behaves exactly as on `/v1/chat/completions`, and greedy text is the same. The output is read into content
blocks and, when streaming, into Anthropic's events (anthropic_events.py). Errors are in Anthropic's shape, with
its status for an invalid request (400); the key comes as `x-api-key` or `Authorization: Bearer` (middleware.py).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

from aiohttp import web

from conveyor.router.api import anthropic as api
from conveyor.router.api.base import parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.core.events import ErrorEvent
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.anthropic_events import MessageEvents, content_of, message, stop_of, usage
from conveyor.router.frontends.middleware import caller, request_id
from conveyor.router.frontends.replies import REQUEST_ERRORS, anthropic_error_response, open_sse, token_text
from conveyor.router.frontends.responses_api_output import new_id
from conveyor.router.pipeline.openai_requests import Choice, OpenAIRequests
from conveyor.router.pipeline.validation import check_limits

BLOCKS_JOINED = "\n\n"  # between the text blocks of one turn (or of the system prompt)

# --- the request: the chat it is -------------------------------------------------------------------------------


def messages_of(body: api.MessagesBase) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages: a user turn's `tool_result` blocks become tool messages (in their
    place among its text), an assistant turn's `tool_use` blocks its tool calls and `thinking` its reasoning."""
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else BLOCKS_JOINED.join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for turn in body.messages:
        if isinstance(turn.content, str):
            messages.append({"role": turn.role, "content": turn.content})
        elif turn.role == "assistant":
            messages.append(_assistant(turn.content))
        else:
            messages += _user(turn.content)
    return messages


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    text = BLOCKS_JOINED.join(b.text for b in blocks if isinstance(b, api.TextBlockParam))
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if isinstance(b, api.ToolUseBlockParam)
    ]
    message_: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message_["tool_calls"] = calls
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, api.ThinkingBlockParam))
    if reasoning:
        message_["reasoning_content"] = reasoning
    return message_


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[Any] = []  # text and image blocks, one user message
    for block in blocks:
        if isinstance(block, api.ToolResultBlockParam):
            if pending:
                out.append(_user_message(pending))
                pending = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            pending.append(block)
    return out + ([_user_message(pending)] if pending else [])


def _user_message(blocks: list[Any]) -> dict[str, Any]:
    """Text blocks joined; with images, the chat's text and image_url parts in the blocks' order."""
    if not any(isinstance(b, api.ImageBlockParam) for b in blocks):
        return {"role": "user", "content": BLOCKS_JOINED.join(b.text for b in blocks)}
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, api.ImageBlockParam):
            parts.append({"type": "image_url", "image_url": {"url": block.data_url()}})
        elif parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += BLOCKS_JOINED + block.text
        else:
            parts.append({"type": "text", "text": block.text})
    return {"role": "user", "content": parts}


def chat_body(body: api.MessagesBase) -> dict[str, Any]:
    """The chat completion request this Messages request (or token count) is."""
    chat: dict[str, Any] = {"messages": messages_of(body)}
    names = ("model", "temperature", "top_p", "top_k", "priority", "cache_salt", "speculate")
    for name in names:
        if getattr(body, name, None) is not None and name in body.model_fields_set:
            chat[name] = getattr(body, name)
    if isinstance(body, api.MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        chat["stop"] = body.stop_sequences
    choice = body.tool_choice
    if body.tools:
        chat["tools"] = [{"type": "function", "function": _function(t)} for t in body.tools]
    if body.tools and choice is not None:  # without tools, auto and none are the same plain chat
        chat["tool_choice"] = _TOOL_CHOICES.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
        chat["parallel_tool_calls"] = not getattr(choice, "disable_parallel_tool_use", False)
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    return chat


_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": the named function


def _function(tool: api.ToolParam) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        spec["description"] = tool.description
    return spec


# --- the routes ------------------------------------------------------------------------------------------------


class AnthropicRoutes:
    def __init__(self, infer: Infer, requests: OpenAIRequests, model_id: str) -> None:
        self.infer, self.requests, self.model_id = infer, requests, model_id
        self.validation = requests.validation

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.create)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def create(self, request: web.Request) -> web.StreamResponse:
        key = caller(request)
        try:
            self.infer.admit(key, 1)  # refused work costs no template and no tokenizing
            body, choice = await self.validation.off_loop(
                self._read, api.MessagesRequest, await request.read(), owner=key.name
            )
        except REQUEST_ERRORS as exc:
            return anthropic_error_response(exc)
        model = body.model or self.model_id
        if body.stream:
            return await self._stream(request, choice, model)
        try:
            answer = await self.infer.generate(choice.request, key, request_id(request))
        except REQUEST_ERRORS as exc:
            return anthropic_error_response(exc)
        finished = answer.finished
        parsed = choice.output.parse(finished.generated_text)
        stop = stop_of(finished, choice.request.parameters.stop, bool(parsed.calls), parsed.whole)
        counts = usage(len(choice.request.input_ids), finished.generated_tokens, finished.cached_tokens)
        return web.json_response(message(new_id("msg"), model, content_of(parsed), stop, counts))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt `/v1/messages` would run, rendered and tokenized as it would be (the same validation)."""
        key = caller(request)
        try:
            self.infer.admit(key, 1)
            _, choice = await self.validation.off_loop(
                self._read, api.CountTokensRequest, await request.read(), owner=key.name
            )
        except REQUEST_ERRORS as exc:
            return anthropic_error_response(exc)
        count: api.MessageTokensCount = {"input_tokens": len(choice.request.input_ids)}
        return web.json_response(count)

    def _read(self, model: type[api.MessagesBase], raw: bytes) -> tuple[api.MessagesBase, Choice]:
        """On a validation worker: the body, and the chat choice it is."""
        body = parse(model, raw)
        check_limits(body, self.validation.limits)  # `max_tokens`, `stop_sequences` named as the caller wrote
        chat = parse(ChatRequest, chat_body(body))
        return body, self.requests.chat_choices(chat)[0]

    async def _stream(self, request: web.Request, choice: Choice, model: str) -> web.StreamResponse:
        key = caller(request)
        async with AsyncExitStack() as stack:
            try:
                events = await stack.enter_async_context(self.infer.stream(choice.request, key, request_id(request)))
            except REQUEST_ERRORS as exc:
                return anthropic_error_response(exc)
            sse = await open_sse(request)
            prompt_tokens = len(choice.request.input_ids)
            out = MessageEvents(sse, message(new_id("msg"), model, [], (None, None), usage(prompt_tokens, 0, 0)))
            await out.start()
            reader = choice.output
            async for event in events:
                if isinstance(event, ErrorEvent):
                    await out.fail(event.message, event.error_type)
                    return sse
                for delta in reader.feed(token_text(event)):
                    await out.piece(delta)
                if (finished := event.finished) is not None:
                    for delta in reader.finish():
                        await out.piece(delta)
                    stop = stop_of(finished, choice.request.parameters.stop, reader.called, reader.whole())
                    await out.finish(stop, usage(prompt_tokens, finished.generated_tokens, finished.cached_tokens))
            return sse
