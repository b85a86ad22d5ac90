"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Each route maps OpenAI's fields onto TGI's parameter names and goes through the same validation, queue and
scheduler as `/generate`. `n` choices are `n` requests run side by side. Errors use OpenAI's shape (with
`error_type` beside it, as every Conveyor error has).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from conveyor.router.events import ErrorEvent, Finished, Token, TokenEvent
from conveyor.router.infer import Infer, Response
from conveyor.router.responses import REQUEST_ERRORS, error_event, error_response, open_sse, send_sse
from conveyor.router.validation import Validation, ValidationError, ValidRequest, parse_json

MAX_CHOICES = 8  # n, and prompts per completion request, at most
FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


def _get(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
        raise ValidationError(f"`{name}` has the wrong type")
    return value


def sampling_parameters(body: dict, logprobs: int) -> dict[str, Any]:
    """OpenAI's fields under TGI's names. Temperature 0 means greedy; unset means sampling at 1, as OpenAI does."""
    temperature = _get(body, "temperature", (int, float), 1.0)
    stop = _get(body, "stop", (str, list), [])
    parameters: dict[str, Any] = {
        "max_new_tokens": _get(body, "max_tokens", int) or _get(body, "max_completion_tokens", int),
        "top_p": _get(body, "top_p", (int, float)),
        "seed": _get(body, "seed", int),
        "stop": [stop] if isinstance(stop, str) else stop,
        "frequency_penalty": _get(body, "frequency_penalty", (int, float)),
        "presence_penalty": _get(body, "presence_penalty", (int, float)),
        "top_n_tokens": logprobs or None,
        "ignore_eos": _get(body, "ignore_eos", bool),
    }
    if temperature == 0:
        parameters["top_p"] = None  # greedy: warpers would turn sampling back on
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
        if body.get("suffix") is not None:
            raise ValidationError("`suffix` is not supported")
        if body.get("echo"):
            raise ValidationError("`echo` is not supported")
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValidationError("`prompt` must be a string or a non-empty list of strings")
        n = _choices(body)
        if len(prompts) * n > MAX_CHOICES:
            raise ValidationError(f"at most {MAX_CHOICES} choices (prompts times `n`) per request")
        logprobs = _get(body, "logprobs", int, 0)
        parameters = sampling_parameters(body, logprobs)
        choices = []
        for p in prompts:
            valid = self.validation.validate_prompt(p, dict(parameters), stream=stream)
            for i in range(n):
                choices.append(Choice(len(choices), _with_seed(valid, i)))
        return choices

    def _chat_choices(self, body: dict, stream: bool) -> list[Choice]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValidationError("`messages` must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise ValidationError("each message needs a `role` of system, user or assistant")
            if not isinstance(m.get("content"), str):
                raise ValidationError("each message needs a string `content`")
        try:
            prompt = self.validation.tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
            raise ValidationError(f"the chat template could not render the messages: {exc}") from None
        top = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool, False) else 0
        if _get(body, "logprobs", bool, False) and not top:
            top = 1  # the chosen token's logprob comes with it; report at least one alternative
        parameters = sampling_parameters(body, top)
        valid = self.validation.validate_prompt(prompt, parameters, stream=stream, add_special_tokens=False)
        return [Choice(i, _with_seed(valid, i)) for i in range(_choices(body))]

    # --- handlers -----------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._completion_choices, CompletionFormat(self.model_id))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._chat_choices, ChatFormat(self.model_id))

    async def _handle(self, request: web.Request, parse: Callable, fmt: Format) -> web.StreamResponse:
        try:
            body = await self._body(request)
            stream = _get(body, "stream", bool, False)
            options = _get(body, "stream_options", dict, {})
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
            "token_logprobs": [e.token.logprob for e in events],
            "top_logprobs": [{t.text: t.logprob for t in e.top_tokens} for e in events],
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
                    "text": event.token.text,
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
        return {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode())}

    def _logprobs(self, events: list[TokenEvent]) -> dict:
        return {
            "content": [
                {**self._entry(e.token), "top_logprobs": [self._entry(t) for t in e.top_tokens]} for e in events
            ]
        }

    def choice(self, choice: Choice, response: Response, logprobs: bool) -> dict:
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": response.finished.generated_text},
            "logprobs": self._logprobs(response.events) if logprobs else None,
            "finish_reason": _finish_reason(response.finished),
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
        return self._envelope(
            self.chunk_name,
            [
                {
                    "index": choice.index,
                    "delta": {"content": event.token.text},
                    "logprobs": self._logprobs([event]) if logprobs else None,
                    "finish_reason": _finish_reason(event.finished),
                }
            ],
        )
