"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is translated into the chat it is (`chat_body`) and goes through the chat route's own steps
(template, tools, constraint, the one validation), so a tool call or a JSON schema behaves exactly as on
`/v1/chat/completions`. The output is read into items (reasoning, the message, function calls) and, when
streaming, into the API's typed events, in the order the SDKs rebuild a response from (`ResponseEvents`). A stored
response keeps the conversation so far, which `previous_response_id` continues (router/frontends/response_store.py).
"""

from __future__ import annotations

import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

from aiohttp import web

from conveyor.router.api import responses_api as api
from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.core.events import ErrorEvent, Finished
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.middleware import caller, request_id
from conveyor.router.frontends.openai_routes import Choice, OpenAIRoutes, token_text
from conveyor.router.frontends.replies import REQUEST_ERRORS, error_response, json_error, open_sse, send_sse
from conveyor.router.frontends.response_store import ResponseStore
from conveyor.router.pipeline.chat_output import Delta
from conveyor.router.pipeline.tools import whole_arguments
from conveyor.router.pipeline.validation import check_limits


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
            messages.append({"role": role, "content": item.text()})
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


# --- the answer: items, the Response object --------------------------------------------------------------------


class Output:
    """One response's output items as they are made, streamed or not."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.whole = True  # no call was cut short (ChatOutput.whole), as known when the output ends

    def reasoning(self) -> dict[str, Any]:
        item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
        self.items.append(item)
        return item

    def message(self) -> dict[str, Any]:
        item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        self.items.append(item)
        return item

    def call(self, call_id: str, name: str) -> dict[str, Any]:
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        return item

    def text(self) -> str:
        return "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])

    def messages(self) -> list[dict[str, Any]]:
        """This output as the chat's next messages (reasoning left out, as chat templates drop it)."""
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.items
            if i["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": self.text() or (None if calls else "")}
        return [{**message, "tool_calls": calls} if calls else message]


def whole_output(text: str, choice: Choice, finished: Finished) -> Output:
    """A finished generation's items: its reasoning, its message, its calls, each with its status at the end."""
    parsed = choice.output.parse(text)
    output = Output()
    if parsed.reasoning:
        output.reasoning()["content"].append({"type": "reasoning_text", "text": parsed.reasoning})
    if parsed.content is not None and (parsed.content or not parsed.calls):
        message = output.message()
        message["content"].append({"type": "output_text", "text": parsed.content or "", "annotations": []})
    for call in parsed.calls:
        output.call(call.id, call.name)["arguments"] = call.arguments
    output.whole = parsed.whole
    for item in output.items:
        if "status" in item:
            item["status"] = _item_status(finished, output.whole)
    return output


class ResponseObject:
    """The Response object's fields that do not change while it is made."""

    def __init__(self, body: api.ResponsesRequest, model: str) -> None:
        self.id, self.created = new_id("resp"), int(time.time())
        self.body, self.model = body, model

    def json(
        self, output: Output, status: str, usage: api.ResponseUsage | None, finished: Finished | None = None
    ) -> dict[str, Any]:
        body = self.body
        incomplete = _incomplete_reason(output, finished)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "model": body.model or self.model,
            "output": output.items,
            "output_text": output.text(),
            "usage": usage,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "tool_choice": _tool_choice(body),
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None
            else {"format": {"type": "text"}},
            "store": body.store,
            "metadata": body.metadata or {},
        }


def _tool_choice(body: api.ResponsesRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, api.NamedTool):
        return choice.model_dump()
    return choice or ("auto" if body.tools else "none")


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> api.ResponseUsage:
    """The Responses API's usage; `cached_tokens`: the prompt tokens the prefix cache served (memory or disk)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


# --- streaming: the typed events --------------------------------------------------------------------------------


class ResponseEvents:
    """Turns a stream's pieces into the Responses API's events, opening and closing items in order: a reasoning
    item, the message (one output_text part), then each function call; every event numbered."""

    def __init__(self, sse: web.StreamResponse, response: ResponseObject) -> None:
        self.sse, self.response = sse, response
        self.output = Output()
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the item receiving pieces now

    async def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        await send_sse(self.sse, event, kind)

    async def start(self) -> None:
        snapshot = self.response.json(Output(), "in_progress", None)
        await self.send("response.created", response=snapshot)
        await self.send("response.in_progress", response=snapshot)

    async def piece(self, delta: Delta) -> None:
        if delta.reasoning:
            item = await self._item("reasoning")
            item["content"][0]["text"] += delta.reasoning
            await self.send("response.reasoning_text.delta", **self._at(item), content_index=0, delta=delta.reasoning)
        if delta.content:
            item = await self._item("message")
            item["content"][0]["text"] += delta.content
            await self.send(
                "response.output_text.delta", **self._at(item), content_index=0, delta=delta.content, logprobs=[]
            )
        if delta.call_index is not None:
            if delta.call_id is not None:
                await self._close()
                self.open = self.output.call(delta.call_id, delta.call_name or "")
                await self.send("response.output_item.added", output_index=self._index(self.open), item=dict(self.open))
            if delta.arguments and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += delta.arguments
                await self.send("response.function_call_arguments.delta", **self._at(self.open), delta=delta.arguments)

    async def finish(self, usage_: api.ResponseUsage, finished: Finished, whole: bool) -> dict[str, Any]:
        """The last events, once the output ended; `whole`: no call was cut short (ChatOutput.whole)."""
        self.output.whole = whole
        if self.open is not None and "status" in self.open:
            self.open["status"] = _item_status(finished, whole)  # the item the output ended in
        await self._close()
        if not self.output.items:  # nothing at all was said: an empty message, as a whole answer has
            await self._item("message")
            await self._close()
        final = self.response.json(self.output, "completed", usage_, finished)
        await self.send(f"response.{final['status']}", response=final)
        return final

    async def fail(self, message: str, error_type: str) -> None:
        await self.send("error", code=error_type, message=message, param=None)

    async def _item(self, kind: str) -> dict[str, Any]:
        """The open item of `kind`, opened (after closing another) if need be."""
        if self.open is not None and self.open["type"] == kind:
            return self.open
        await self._close()
        self.open = self.output.reasoning() if kind == "reasoning" else self.output.message()
        await self.send("response.output_item.added", output_index=self._index(self.open), item=_opened(self.open))
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        self.open["content"].append(part)
        await self.send("response.content_part.added", **self._at(self.open), content_index=0, part=dict(part))
        return self.open

    async def _close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        if item["type"] == "function_call":
            await self.send("response.function_call_arguments.done", **self._at(item), arguments=item["arguments"])
        else:
            text = item["content"][0]["text"]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            await self.send(done, **self._at(item), content_index=0, text=text, **_logprobs(item))
            await self.send("response.content_part.done", **self._at(item), content_index=0, part=item["content"][0])
        if item.get("status") == "in_progress":
            item["status"] = "completed" if _whole_call(item) else "incomplete"
        await self.send("response.output_item.done", output_index=self._index(item), item=item)

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, known in enumerate(self.output.items) if known is item)

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index(item)}


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _logprobs(item: dict[str, Any]) -> dict[str, Any]:
    return {"logprobs": []} if item["type"] == "message" else {}


# --- the routes -----------------------------------------------------------------------------------------------------


class ResponsesRoutes:
    def __init__(self, infer: Infer, chat: OpenAIRoutes, store: ResponseStore | None = None) -> None:
        self.infer, self.chat = infer, chat
        self.store = store or ResponseStore()

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.get)
        app.router.add_delete("/v1/responses/{id}", self.delete)

    async def create(self, request: web.Request) -> web.StreamResponse:
        key = caller(request)
        try:
            self.infer.admit(key, 1)  # refused work costs no template and no tokenizing
            body = await self.chat.validation.off_loop(
                parse, api.ResponsesRequest, await request.read(), owner=key.name
            )
            messages = self._history(key.name, body) + messages_of(body)
            choice = await self.chat.validation.off_loop(self._choice, body, messages, owner=key.name)
        except PreviousResponseMissing as missing:
            return _not_found(str(missing), "`previous_response_id`: ")
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        response = ResponseObject(body, self.chat.model_id)
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
        check_limits(body, self.chat.validation.limits)  # `max_output_tokens` named as the caller wrote it
        if not messages:
            raise ValidationError("`input` has nothing to answer: reasoning items alone are not shown to the model")
        chat = parse(ChatRequest, chat_body(body, messages))
        return self.chat._chat_choices(chat)[0]

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


def _item_status(finished: Finished, whole: bool) -> str:
    """The status of the item the output ended in: incomplete if the token limit cut it, or a call in it was cut
    short otherwise (not `whole`); else completed."""
    return "incomplete" if finished.finish_reason == "length" or not whole else "completed"


def _whole_call(item: dict[str, Any]) -> bool:
    """Not a function call, or one whose arguments are whole JSON (a call broken off mid-stream is not)."""
    return item["type"] != "function_call" or whole_arguments(item["arguments"])


def _incomplete_reason(output: Output, finished: Finished | None) -> str | None:
    """Why the response is incomplete, None if it is not (or not finished yet): the token limit cut it
    (`max_output_tokens`), or it ended before a call's arguments were whole JSON (`stop`: a stop sequence, or a
    grammar that failed), and a call cut short is not answered as made."""
    if finished is None:
        return None
    if finished.finish_reason == "length":
        return "max_output_tokens"
    return None if output.whole else "stop"


class PreviousResponseMissing(LookupError):
    """`previous_response_id` names no response stored for this key (expired, deleted, another key's, never)."""


def _not_found(response_id: str, where: str = "") -> web.Response:
    return json_error(404, f"{where}no stored response {response_id!r} for this API key", "not_found", openai=True)
