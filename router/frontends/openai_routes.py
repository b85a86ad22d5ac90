"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Each route maps OpenAI's fields onto TGI's parameter names and goes through the same validation, queue and
scheduler as `/generate`. `n` choices are `n` requests run side by side. Errors use OpenAI's shape (with
`error_type` beside it, as every Conveyor error has).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from conveyor.grammar import Constraint
from conveyor.router.api import openai as api
from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.openai import (
    MAX_CHOICES,
    ChatRequest,
    CompletionRequest,
    Message,
    MessageToolCall,
    OpenAIRequest,
)
from conveyor.router.core.events import ErrorEvent, Finished, Token, TokenEvent
from conveyor.router.core.infer import Infer, Response
from conveyor.router.frontends.middleware import caller, holds_admin_key, request_id
from conveyor.router.frontends.replies import (
    REQUEST_ERRORS,
    error_event,
    error_response,
    open_sse,
    openai_logprob,
    send_sse,
)
from conveyor.router.pipeline.chat_output import ChatOutput, Delta
from conveyor.router.pipeline.chat_prompt import ChatPrompt, render_chat, template_kwargs
from conveyor.router.pipeline.reasoning import Reasoning
from conveyor.router.pipeline.request import ValidRequest, from_chat, from_completion
from conveyor.router.pipeline.tools import ToolUse, tool_use
from conveyor.router.pipeline.validation import Validation

FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


def _with_seed(valid: ValidRequest, index: int) -> ValidRequest:
    """Choice i of a seeded request uses seed + i, so the choices differ but each is reproducible."""
    seed = valid.parameters.seed
    if seed is None or index == 0:
        return valid
    sampling = valid.parameters.sampling.model_copy(update={"seed": (seed + index) % 2**64})
    return replace(valid, parameters=replace(valid.parameters, sampling=sampling))


@dataclass
class Choice:
    index: int
    request: ValidRequest
    output: ChatOutput | None = None  # a chat choice's reader: its reasoning, content and tool calls


class OpenAIRoutes:
    def __init__(self, infer: Infer, validation: Validation, model_id: str) -> None:
        self.infer = infer
        self.validation = validation
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

    # --- request parsing ----------------------------------------------------------------------------------

    def _completion_choices(self, request: CompletionRequest) -> list[Choice]:
        prompts = request.prompts
        if len(prompts) * request.n > MAX_CHOICES:
            raise ValidationError(f"at most {MAX_CHOICES} choices (prompts times `n`) per request")
        choices = []
        for p in prompts:
            valid = self.validation.validate(from_completion(request, p))
            for i in range(request.n):
                choices.append(Choice(len(choices), _with_seed(valid, i)))
        return choices

    def _chat_choices(self, request: ChatRequest) -> list[Choice]:
        tools = tool_use(request)
        prompt = self._render_chat([_message(m) for m in request.messages], tools, request.chat_template_kwargs)
        parsers = self.validation.parsers
        reasoning = parsers.reasoning_of(prompt.text)
        grammar = _chat_constraint(request, tools, reasoning)
        valid = self.validation.validate(from_chat(request, prompt, grammar))
        return [Choice(i, _with_seed(valid, i), parsers.output(tools, reasoning)) for i in range(request.n)]

    def _render_chat(self, messages: list[dict], tools: ToolUse | None, kwargs: dict | None) -> ChatPrompt:
        validation = self.validation
        trusted = validation.chat_special_tokens
        extra = template_kwargs(kwargs, validation.tokenizer, validation.special_texts, trusted) if kwargs else {}

        def render(messages: list[dict], tools: list[dict] | None) -> str:
            with_tools = {"tools": tools} if tools is not None else {}
            return validation.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra, **with_tools
            )

        specs = tools.template_tools() if tools is not None else None
        try:
            return render_chat(render, messages, validation.special_texts, trusted, specs)
        except ValidationError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
            raise ValidationError(f"the chat template could not render the messages: {exc}") from None

    # --- handlers -----------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CompletionRequest, self._completion_choices, CompletionFormat(self.model_id))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, ChatRequest, self._chat_choices, ChatFormat(self.model_id))

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
                    await send_sse(response, fmt.usage_chunk(_usage(prompt_tokens, completion_tokens, cached_tokens)))
                await response.write(b"data: [DONE]\n\n")
            return response


def _chat_constraint(request: ChatRequest, tools: ToolUse | None, reasoning: Reasoning | None) -> Constraint | None:
    """The body's constraint or the one a forced call implies (not both), on the answer after any reasoning."""
    grammar = request.constraint()
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if grammar is not None:
            raise ValidationError("a `response_format` or other constraint cannot be combined with this `tool_choice`")
        grammar = forced
    return reasoning.constrain(grammar) if reasoning is not None else grammar


def _message(message: Message) -> dict[str, Any]:
    """A message as the chat template gets it. An assistant's tool calls carry their arguments as JSON text in
    OpenAI's API; chat templates expect them parsed."""
    out = message.model_dump(exclude_unset=True, exclude={"tool_calls"})
    if message.tool_calls:
        out["content"] = message.content  # null beside calls: templates test for it
        out["tool_calls"] = [_template_call(c) for c in message.tool_calls]
    return out


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: JSON text nested thousands deep
            raise ValidationError("a tool call's `arguments` must be JSON text") from None
    entry = call.model_dump(exclude_unset=True)
    return {**entry, "function": {"name": call.function.name, "arguments": arguments}}


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


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> api.Usage:
    """OpenAI's usage, `cached_tokens` included: the prompt tokens the prefix cache served, which OpenAI bills
    for less, so a caller can see what a shared prefix saved."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Format:
    """The JSON shapes of one OpenAI route."""

    object_name = ""
    chunk_name = ""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    prefix = ""

    def _envelope(self, name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model_id, "choices": choices}

    def response(self, results: list[tuple[Choice, Response]], logprobs: bool) -> dict:
        body = self._envelope(self.object_name, [self.choice(c, r, logprobs) for c, r in results])
        body["usage"] = _usage(
            sum(len(c.request.input_ids) for c, _ in results),
            sum(r.finished.generated_tokens for _, r in results),
            sum(r.finished.cached_tokens for _, r in results),
        )
        return body

    def usage_chunk(self, usage: api.Usage) -> dict:
        return {**self._envelope(self.chunk_name, []), "usage": usage}

    def opening(self, choices: list[Choice]) -> list[dict]:
        return []

    def choice(self, choice: Choice, response: Response, logprobs: bool) -> dict:
        raise NotImplementedError

    def chunk(self, choice: Choice, event: TokenEvent, logprobs: bool) -> dict:
        raise NotImplementedError


def _finish_reason(finished: Finished | None) -> str | None:
    return None if finished is None else FINISH[finished.finish_reason]


def token_text(event: TokenEvent) -> str:
    """A streamed token's text; the special token that ended the output is not part of it (as in the answer's
    whole text), though its logprob entry still names it."""
    ended = event.finished is not None and event.finished.finish_reason == "eos_token"
    return "" if ended and event.token.special else event.token.text


def _tool_finish(finish_reason: str | None, whole: bool) -> str | None:
    """A choice that ended with calls ends for them (`tool_calls`) if none was cut short (`whole`); else it says
    how it ended, `length` (the token limit) or `stop` (a stop sequence inside a forced call's JSON), so that no
    client runs a call whose arguments are not JSON."""
    return "tool_calls" if finish_reason == "stop" and whole else finish_reason


class CompletionFormat(Format):
    object_name = chunk_name = "text_completion"
    prefix = "cmpl"

    @staticmethod
    def _logprobs(events: list[TokenEvent]) -> api.CompletionLogprobs:
        offsets, position = [], 0
        for e in events:
            offsets.append(position)
            position += len(e.token.text)
        return {
            "tokens": [e.token.text for e in events],
            "token_logprobs": [openai_logprob(e.token) for e in events],
            "top_logprobs": [{t.text: openai_logprob(t) for t in e.top_tokens} for e in events],
            "text_offset": offsets,
        }

    def choice(self, choice: Choice, response: Response, logprobs: bool) -> api.CompletionChoice:
        return {
            "index": choice.index,
            "text": response.finished.generated_text,
            "logprobs": self._logprobs(response.events) if logprobs else None,
            "finish_reason": _finish_reason(response.finished),
        }

    def chunk(self, choice: Choice, event: TokenEvent, logprobs: bool) -> dict:
        return self._envelope(
            self.chunk_name,
            [
                {
                    "index": choice.index,
                    "text": token_text(event),
                    "logprobs": self._logprobs([event]) if logprobs else None,
                    "finish_reason": _finish_reason(event.finished),
                }
            ],
        )


class ChatFormat(Format):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    prefix = "chatcmpl"

    @staticmethod
    def _entry(token: Token) -> api.LogprobEntry:
        return {"token": token.text, "logprob": openai_logprob(token), "bytes": list(token.text.encode())}

    def _logprobs(self, events: list[TokenEvent]) -> api.ChatLogprobs:
        return {
            "content": [
                {**self._entry(e.token), "top_logprobs": [self._entry(t) for t in e.top_tokens]} for e in events
            ]
        }

    def choice(self, choice: Choice, response: Response, logprobs: bool) -> api.ChatChoice:
        assert choice.output is not None
        parsed = choice.output.parse(response.finished.generated_text)
        message: api.AssistantMessage = {"role": "assistant", "content": parsed.content}
        if choice.output.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        finish_reason = _finish_reason(response.finished)
        if parsed.calls:
            message["tool_calls"] = [call.message() for call in parsed.calls]
            finish_reason = _tool_finish(finish_reason, parsed.whole)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(response.events) if logprobs else None,
            "finish_reason": finish_reason,
        }

    def opening(self, choices: list[Choice]) -> list[dict]:
        """OpenAI's first chunk of each choice names the role and carries no text."""
        return [
            self._envelope(
                self.chunk_name,
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for c in choices
        ]

    def chunk(self, choice: Choice, event: TokenEvent, logprobs: bool) -> dict:
        """One token's chunk: what the token completes of the reasoning, the content and the calls (nothing, while
        it may be the start of a marker), and at the end what is still owed."""
        output = choice.output
        assert output is not None
        deltas = output.feed(token_text(event))
        finish_reason = _finish_reason(event.finished)
        if event.finished is not None:
            deltas += output.finish()
            finish_reason = _tool_finish(finish_reason, output.whole()) if output.called else finish_reason
        delta = _chat_delta(deltas, plain=output.tools is None and output.reasoning is None)
        return self._envelope(
            self.chunk_name,
            [
                {
                    "index": choice.index,
                    "delta": delta,
                    "logprobs": self._logprobs([event]) if logprobs else None,
                    "finish_reason": finish_reason,
                }
            ],
        )


def _chat_delta(deltas: list[Delta], plain: bool) -> api.Delta:
    """OpenAI's delta for a token's pieces. A plain chat (no tools, no reasoning) always has its `content`, as
    before tools existed; others only what the token completed."""
    delta: api.Delta = {}
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content or plain:
        delta["content"] = content
    if calls := _call_deltas(deltas):
        delta["tool_calls"] = calls
    return delta


def _call_deltas(deltas: list[Delta]) -> list[api.ToolCallDelta]:
    """A call's first piece names it (id, type, name); the others add to its arguments, one entry per call."""
    out: list[api.ToolCallDelta] = []
    for d in deltas:
        if d.call_index is None:
            continue
        if d.call_id is not None:
            function = {"name": d.call_name or "", "arguments": d.arguments}
            out.append({"index": d.call_index, "id": d.call_id, "type": "function", "function": function})
        elif out and out[-1]["index"] == d.call_index:
            out[-1]["function"]["arguments"] += d.arguments
        else:
            out.append({"index": d.call_index, "function": {"arguments": d.arguments}})
    return out
