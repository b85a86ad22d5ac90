"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is translated into the chat it is (`chat_body`) and goes through the chat route's own steps
(template, tools, constraint, the one validation: `pipeline/openai_requests.py`), so a tool call or a JSON schema
behaves exactly as on `/v1/chat/completions`. The answer's items and streamed events are shaped in
`responses_api_output.py`. A stored response keeps the conversation so far, which `previous_response_id` continues
(router/frontends/response_store.py).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

from aiohttp import web

from conveyor.router.api import responses_api as api
from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.core.events import ErrorEvent
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.middleware import caller, request_id
from conveyor.router.frontends.replies import REQUEST_ERRORS, error_response, json_error, open_sse, token_text
from conveyor.router.frontends.response_store import ResponseStore
from conveyor.router.frontends.responses_api_output import ResponseEvents, ResponseObject, usage, whole_output
from conveyor.router.pipeline.openai_requests import Choice, OpenAIRequests
from conveyor.router.pipeline.validation import check_limits

# --- the request: the chat it is -------------------------------------------------------------------------------


def messages_of(body: api.ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages (a previous response's come before them)."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, api.MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.chat_content()})
        elif isinstance(item, api.FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, api.FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return messages


def chat_body(body: api.ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request this Responses request is."""
    chat: dict[str, Any] = {"messages": messages, "parallel_tool_calls": body.parallel_tool_calls}
    for name in ("model", "temperature", "top_p", "priority", "cache_salt", "speculate", "user"):
        if getattr(body, name) is not None and name in body.model_fields_set:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": _function(t)} for t in body.tools]
    if isinstance(body.tool_choice, api.NamedTool):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = _response_format(body.text.format)
    return chat


def _function(tool: api.FunctionTool) -> dict[str, Any]:
    return tool.model_dump(exclude_unset=True, exclude={"type"})


def _response_format(fmt: Any) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    spec = {"name": fmt.name, "schema": fmt.schema_}
    return {"type": "json_schema", "json_schema": spec if fmt.strict is None else {**spec, "strict": fmt.strict}}


# --- the routes -----------------------------------------------------------------------------------------------------


class ResponsesRoutes:
    def __init__(
        self, infer: Infer, requests: OpenAIRequests, model_id: str, store: ResponseStore | None = None
    ) -> None:
        self.infer, self.requests, self.model_id = infer, requests, model_id
        self.validation = requests.validation
        self.store = store or ResponseStore()

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.get)
        app.router.add_delete("/v1/responses/{id}", self.delete)

    async def create(self, request: web.Request) -> web.StreamResponse:
        key = caller(request)
        try:
            self.infer.admit(key, 1)  # refused work costs no template and no tokenizing
            body = await self.validation.off_loop(parse, api.ResponsesRequest, await request.read(), owner=key.name)
            messages = self._history(key.name, body) + messages_of(body)
            choice = await self.validation.off_loop(self._choice, body, messages, owner=key.name)
        except PreviousResponseMissing as missing:
            return _not_found(str(missing), "`previous_response_id`: ")
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        response = ResponseObject(body, self.model_id)
        if body.stream:
            return await self._stream(request, body, choice, response, messages)
        try:
            answer = await self.infer.generate(choice.request, key, request_id(request))
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        finished = answer.finished
        output = whole_output(finished.generated_text, choice, finished)
        counts = usage(len(choice.request.input_ids), finished.generated_tokens, finished.cached_tokens)
        final = response.json(output, "completed", counts, finished)
        self._keep(key.name, body, final, messages + output.messages())
        return web.json_response(final)

    def _history(self, owner: str, body: api.ResponsesRequest) -> list[dict[str, Any]]:
        if body.previous_response_id is None:
            return []
        stored = self.store.get(owner, body.previous_response_id)
        if stored is None:
            raise PreviousResponseMissing(body.previous_response_id)
        return list(stored.messages)

    def _choice(self, body: api.ResponsesRequest, messages: list[dict[str, Any]]) -> Choice:
        check_limits(body, self.validation.limits)  # `max_output_tokens` named as the caller wrote it
        if not messages:
            raise ValidationError("`input` has nothing to answer: reasoning items alone are not shown to the model")
        chat = parse(ChatRequest, chat_body(body, messages))
        return self.requests.chat_choices(chat)[0]

    def _keep(self, owner: str, body: api.ResponsesRequest, final: dict[str, Any], messages: list[dict]) -> None:
        if body.store:
            self.store.put(owner, final, messages)

    async def _stream(
        self,
        request: web.Request,
        body: api.ResponsesRequest,
        choice: Choice,
        response: ResponseObject,
        messages: list[dict[str, Any]],
    ) -> web.StreamResponse:
        key = caller(request)
        async with AsyncExitStack() as stack:
            try:
                events = await stack.enter_async_context(self.infer.stream(choice.request, key, request_id(request)))
            except REQUEST_ERRORS as exc:
                return error_response(exc, openai=True)
            sse = await open_sse(request)
            out = ResponseEvents(sse, response)
            await out.start()
            reader, count = choice.output.fresh(), 0
            async for event in events:
                if isinstance(event, ErrorEvent):
                    await out.fail(event.message, event.error_type)
                    return sse
                count += 1
                for delta in reader.feed(token_text(event)):
                    await out.piece(delta)
                if event.finished is not None:
                    for delta in reader.finish():
                        await out.piece(delta)
                    counts = usage(len(choice.request.input_ids), count, event.finished.cached_tokens)
                    final = await out.finish(counts, event.finished, reader.whole())
                    self._keep(key.name, body, final, messages + out.output.messages())
            return sse

    async def get(self, request: web.Request) -> web.Response:
        stored = self.store.get(caller(request).name, request.match_info["id"])
        if stored is None:
            return _not_found(request.match_info["id"])
        return web.json_response(stored.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        if not self.store.delete(caller(request).name, response_id):
            return _not_found(response_id)
        deleted: api.ResponseDeleted = {"id": response_id, "object": "response", "deleted": True}
        return web.json_response(deleted)


class PreviousResponseMissing(LookupError):
    """`previous_response_id` names no response stored for this key (expired, deleted, another key's, never)."""


def _not_found(response_id: str, where: str = "") -> web.Response:
    return json_error(404, f"{where}no stored response {response_id!r} for this API key", "not_found", openai=True)
