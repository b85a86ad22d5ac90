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
from conveyor.router.events import ErrorEvent, Finished, Token, TokenEvent
from conveyor.router.infer import Infer, Response
from conveyor.router.responses import (
    REQUEST_ERRORS,
    error_event,
    error_response,
    open_sse,
    openai_logprob,
    send_sse,
)
from conveyor.router.structured import VLLM_FIELDS, openai_constraint
from conveyor.router.tools import ToolStream, ToolUse, parse_tool_use
from conveyor.router.validation import Validation, ValidationError, ValidRequest, parse_json

MAX_CHOICES = 8  # n, and prompts per completion request, at most
MAX_MESSAGES = 1024  # messages per chat request: far beyond any conversation that fits a context window
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
_STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *VLLM_FIELDS})

# Every field each route knows. Anything else is refused rather than ignored: an ignored field the client meant
# (`top_k`, `min_p`...) would silently change what it gets. Fields Conveyor knows but does not
# implement pass only with their neutral value (see `_unsupported`); `model` and `user` are accepted and ignored.
_COMMON_FIELDS = (
    frozenset(
        {
            "model",
            "user",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stream",
            "stream_options",
            "stop",
            "presence_penalty",
            "frequency_penalty",
            "seed",
            "logprobs",
            "logit_bias",
            "ignore_eos",
        }
    )
    | _STRUCTURED_FIELDS
)
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
}
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_ROLES = ("system", "user", "assistant", "tool")


def _get(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
        raise ValidationError(f"`{name}` has the wrong type")
    return value


def _check_fields(body: dict, known: frozenset[str]) -> None:
    unknown = sorted(name for name in body if name not in known)
    if unknown:
        raise ValidationError(f"unknown field `{unknown[0]}`: Conveyor does not support it")
    _get(body, "model", str)
    _get(body, "user", str)


def _unsupported(body: dict) -> None:
    """OpenAI fields Conveyor does not implement: their neutral values pass (clients send some of them by
    default), any other value is refused, since ignoring it would answer a different request."""
    if body.get("functions") not in (None, []):
        raise ValidationError("`functions` is not supported: use `tools`")
    if body.get("function_call") not in (None, "none"):
        raise ValidationError("`function_call` is not supported: use `tool_choice`")
    if body.get("logit_bias") not in (None, {}):
        raise ValidationError("`logit_bias` is not supported")
    if _get(body, "best_of", int, 1) != 1:
        raise ValidationError("`best_of` other than 1 is not supported")
    if _get(body, "echo", bool, False):
        raise ValidationError("`echo` is not supported")
    if body.get("suffix") is not None:
        raise ValidationError("`suffix` is not supported")


def _max_tokens(body: dict) -> int | None:
    """`max_tokens`, or its newer name; 0 is passed on (and refused), not taken as unset. Both may come only with
    one value: the other was once ignored unchecked, so that `max_completion_tokens: 0` passed beside a
    `max_tokens`."""
    max_tokens = _get(body, "max_tokens", int)
    newer = _get(body, "max_completion_tokens", int)
    if max_tokens is not None and newer is not None and newer != max_tokens:
        raise ValidationError("`max_tokens` and `max_completion_tokens` name one limit: give one, or equal values")
    return max_tokens if max_tokens is not None else newer


def _stream_options(body: dict, stream: bool) -> dict:
    options = _get(body, "stream_options", dict, {})
    if options and not stream:
        raise ValidationError("`stream_options` is only allowed when `stream` is true")
    unknown = sorted(name for name in options if name != "include_usage")
    if unknown:
        raise ValidationError(f"unknown field `stream_options.{unknown[0]}`")
    _get(options, "include_usage", bool)
    return options


def sampling_parameters(body: dict, logprobs: int) -> dict[str, Any]:
    """OpenAI's fields under TGI's names. Temperature 0 means greedy; unset means sampling, at the model's default
    temperature (generation_config.json) or else 1, as OpenAI and vLLM do."""
    temperature = _get(body, "temperature", (int, float))
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValidationError(f"`temperature` must be >= 0 and <= {MAX_TEMPERATURE:g}. Given: {temperature:g}")
    stop = _get(body, "stop", (str, list), [])
    parameters: dict[str, Any] = {
        "grammar": openai_constraint(body),
        "max_new_tokens": _max_tokens(body),
        "top_p": _get(body, "top_p", (int, float)),
        "seed": _get(body, "seed", int),
        "stop": [stop] if isinstance(stop, str) else stop,
        "frequency_penalty": _get(body, "frequency_penalty", (int, float)),
        "presence_penalty": _get(body, "presence_penalty", (int, float)),
        "top_n_tokens": logprobs or None,
        "ignore_eos": _get(body, "ignore_eos", bool),
    }
    if temperature == 0:
        top_p = parameters["top_p"]
        if top_p is not None and not 0 < top_p <= 1:  # checked although unused, as it would be when sampling
            raise ValidationError("`top_p` must be > 0.0 and <= 1.0")
        parameters["top_p"] = None  # greedy: warpers would turn sampling back on
        parameters["do_sample"] = False  # and so would the model's default warpers
    else:
        parameters.update(temperature=temperature, do_sample=True)
    return {k: v for k, v in parameters.items() if v is not None}


def _choices(body: dict) -> int:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ValidationError(f"`n` must be between 1 and {MAX_CHOICES}")
    return n


def _with_seed(valid: ValidRequest, index: int) -> ValidRequest:
    """Choice i of a seeded request uses seed + i, so the choices differ but each is reproducible."""
    seed = valid.parameters.seed
    if seed is None or index == 0:
        return valid
    return replace(valid, parameters=replace(valid.parameters, seed=(seed + index) % 2**64))


@dataclass
class Choice:
    index: int
    request: ValidRequest
    tools: ToolUse | None = None
    tool_stream: ToolStream | None = None  # a streamed choice's tool-call state


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
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "conveyor"}
        return web.json_response({"object": "list", "data": [model]})

    # --- request parsing ----------------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict:
        body = await self.validation.off_loop(parse_json, await request.read())
        if not isinstance(body, dict):
            raise ValidationError("request body must be a JSON object")
        return body

    def _completion_choices(self, body: dict, stream: bool) -> list[Choice]:
        _check_fields(body, COMPLETION_FIELDS)
        _unsupported(body)
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValidationError("`prompt` must be a string or a non-empty list of strings")
        n = _choices(body)
        if len(prompts) * n > MAX_CHOICES:
            raise ValidationError(f"at most {MAX_CHOICES} choices (prompts times `n`) per request")
        logprobs = self._top_logprobs(body, "logprobs")
        parameters = sampling_parameters(body, logprobs)
        choices = []
        for p in prompts:
            valid = self.validation.validate_prompt(p, dict(parameters), stream=stream)
            for i in range(n):
                choices.append(Choice(len(choices), _with_seed(valid, i)))
        return choices

    def _top_logprobs(self, body: dict, name: str) -> int:
        """Alternatives per token (`logprobs` of completions, `top_logprobs` of chat), within the server's limit."""
        count = _get(body, name, int, 0)
        limit = self.validation.limits.max_top_n_tokens
        if not 0 <= count <= limit:
            raise ValidationError(f"`{name}` must be >= 0 and <= {limit}. Given: {count}")
        return count

    def _chat_choices(self, body: dict, stream: bool) -> list[Choice]:
        _check_fields(body, CHAT_FIELDS)
        _unsupported(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValidationError("`messages` must be a non-empty list")
        if len(messages) > MAX_MESSAGES:
            raise ValidationError(f"at most {MAX_MESSAGES} `messages` per request. Given: {len(messages)}")
        tools = parse_tool_use(body)
        prompt = self._render_chat([_message(m) for m in messages], tools)
        wants_logprobs = _get(body, "logprobs", bool, False)
        top = self._top_logprobs(body, "top_logprobs")
        if top and not wants_logprobs:
            raise ValidationError("`top_logprobs` needs `logprobs` set to true")
        if wants_logprobs and not top:
            top = 1  # the chosen token's logprob comes with it; report at least one alternative
        parameters = sampling_parameters(body, top)
        forced = tools.constraint() if tools is not None else None
        if forced is not None:
            if parameters.get("grammar") is not None:
                raise ValidationError(
                    "a `response_format` or other constraint cannot be combined with this `tool_choice`"
                )
            parameters["grammar"] = forced
        valid = self.validation.validate_prompt(prompt, parameters, stream=stream, add_special_tokens=False)
        return [Choice(i, _with_seed(valid, i), tools) for i in range(_choices(body))]

    def _render_chat(self, messages: list[dict], tools: ToolUse | None) -> str:
        extra = {"tools": tools.template_tools()} if tools is not None else {}
        try:
            return self.validation.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra
            )
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
            raise ValidationError(f"the chat template could not render the messages: {exc}") from None

    # --- handlers -----------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._completion_choices, CompletionFormat(self.model_id))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._chat_choices, ChatFormat(self.model_id))

    async def _handle(self, request: web.Request, parse: Callable, fmt: Format) -> web.StreamResponse:
        try:
            body = await self._body(request)
            stream = _get(body, "stream", bool, False)
            options = _stream_options(body, stream)
            choices = await self.validation.off_loop(parse, body, stream)
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        wants_logprobs = any(c.request.parameters.top_n_tokens for c in choices)
        if stream:
            return await self._stream(request, choices, fmt, bool(options.get("include_usage")), wants_logprobs)
        try:
            responses = await asyncio.gather(*(self.infer.generate(c.request) for c in choices))
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        body = fmt.response([(c, r) for c, r in zip(choices, responses)], wants_logprobs)
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, choices: list[Choice], fmt: Format, include_usage: bool, logprobs: bool
    ) -> web.StreamResponse:
        async with AsyncExitStack() as stack:
            try:
                streams = [await stack.enter_async_context(self.infer.stream(c.request)) for c in choices]
            except REQUEST_ERRORS as exc:
                return error_response(exc, openai=True)
            response = await open_sse(request)
            for chunk in fmt.opening(choices):
                await send_sse(response, chunk)
            usage = {"prompt_tokens": sum(len(c.request.input_ids) for c in choices), "completion_tokens": 0}
            async for choice, event in _merge(choices, streams):
                if isinstance(event, ErrorEvent):
                    await send_sse(response, error_event(event, openai=True))
                    break
                usage["completion_tokens"] += 1
                await send_sse(response, fmt.chunk(choice, event, logprobs))
            else:
                if include_usage:
                    await send_sse(response, fmt.usage_chunk(_usage(usage)))
                await response.write(b"data: [DONE]\n\n")
            return response


def _message(message: object) -> dict[str, Any]:
    """A checked message as the chat template gets it. An assistant's tool calls carry their arguments as JSON
    text in OpenAI's API; chat templates expect them parsed."""
    if not isinstance(message, dict):
        raise ValidationError("each message must be a JSON object with a `role` and a string `content`")
    unknown = sorted(name for name in message if name not in _MESSAGE_FIELDS)
    if unknown:
        raise ValidationError(f"unknown field `{unknown[0]}` in a message")
    role = message.get("role")
    if role not in _ROLES:
        raise ValidationError("each message needs a `role` of system, user, assistant or tool")
    _get(message, "name", str)
    _get(message, "tool_call_id", str)
    calls = _get(message, "tool_calls", list)
    if calls and role != "assistant":
        raise ValidationError("only assistant messages carry `tool_calls`")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ValidationError("a message of role tool needs the string `tool_call_id` it answers")
    if not calls and not isinstance(message.get("content"), str):
        raise ValidationError("each message needs a string `content`")
    if calls and message.get("content") is not None and not isinstance(message["content"], str):
        raise ValidationError("`content` must be a string or null")
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if calls:
        out["tool_calls"] = [_template_call(c) for c in calls]
    return out


def _template_call(call: object) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValidationError('each of `tool_calls` must be {"id": ..., "type": "function", "function": {...}}')
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: JSON text nested thousands deep
            raise ValidationError("a tool call's `arguments` must be JSON text") from None
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


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


def _usage(counts: dict[str, int]) -> dict[str, int]:
    return {**counts, "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}


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
            {
                "prompt_tokens": sum(len(c.request.input_ids) for c, _ in results),
                "completion_tokens": sum(r.finished.generated_tokens for _, r in results),
            }
        )
        return body

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(self.chunk_name, []), "usage": usage}

    def opening(self, choices: list[Choice]) -> list[dict]:
        return []

    def choice(self, choice: Choice, response: Response, logprobs: bool) -> dict:
        raise NotImplementedError

    def chunk(self, choice: Choice, event: TokenEvent, logprobs: bool) -> dict:
        raise NotImplementedError


def _finish_reason(finished: Finished | None) -> str | None:
    return None if finished is None else FINISH[finished.finish_reason]


def _text(event: TokenEvent) -> str:
    """A streamed token's text; the special token that ended the output is not part of it (as in the answer's
    whole text), though its logprob entry still names it."""
    ended = event.finished is not None and event.finished.finish_reason == "eos_token"
    return "" if ended and event.token.special else event.token.text


def _tool_finish(finish_reason: str | None) -> str | None:
    """A choice that ended with calls ends for them; one cut off by the token limit says so."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class CompletionFormat(Format):
    object_name = chunk_name = "text_completion"
    prefix = "cmpl"

    @staticmethod
    def _logprobs(events: list[TokenEvent]) -> dict:
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

    def choice(self, choice: Choice, response: Response, logprobs: bool) -> dict:
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
                    "text": _text(event),
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
    def _entry(token: Token) -> dict:
        return {"token": token.text, "logprob": openai_logprob(token), "bytes": list(token.text.encode())}

    def _logprobs(self, events: list[TokenEvent]) -> dict:
        return {
            "content": [
                {**self._entry(e.token), "top_logprobs": [self._entry(t) for t in e.top_tokens]} for e in events
            ]
        }

    def choice(self, choice: Choice, response: Response, logprobs: bool) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": response.finished.generated_text}
        finish_reason = _finish_reason(response.finished)
        if choice.tools is not None:
            message["content"], calls = choice.tools.parse(response.finished.generated_text)
            if calls:
                message["tool_calls"] = [call.message() for call in calls]
                finish_reason = _tool_finish(finish_reason)
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
        delta: dict[str, Any] = {"content": _text(event)}
        finish_reason = _finish_reason(event.finished)
        if choice.tools is not None:
            delta, finish_reason = self._tool_delta(choice, event, finish_reason)
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

    @staticmethod
    def _tool_delta(choice: Choice, event: TokenEvent, finish_reason: str | None) -> tuple[dict, str | None]:
        """What a choice with tools sends for this token: content, call deltas, or nothing yet (held back)."""
        if choice.tool_stream is None:
            choice.tool_stream = ToolStream(choice.tools)
        delta = choice.tool_stream.feed(_text(event))
        if event.finished is None:
            return delta, finish_reason
        last = choice.tool_stream.finish()
        if "content" in last:
            delta["content"] = delta.get("content", "") + last["content"]
        if last.get("tool_calls"):
            delta["tool_calls"] = delta.get("tool_calls", []) + last["tool_calls"]
        if choice.tool_stream.calls:
            finish_reason = _tool_finish(finish_reason)
        return delta, finish_reason
