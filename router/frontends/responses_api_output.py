"""The Responses API's answer: the output read into items (reasoning, the message, function calls), the Response
object around them, and, when streaming, the API's typed events in the order the SDKs rebuild a response from
(`ResponseEvents`). The routes beside it (`responses_api_routes.py`) turn the request into a chat and run it."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from conveyor.router.api import responses_api as api
from conveyor.router.core.events import Finished
from conveyor.router.frontends.replies import send_sse
from conveyor.router.pipeline.chat_output import ChatDelta
from conveyor.router.pipeline.openai_requests import Choice
from conveyor.router.pipeline.tools import whole_arguments


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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

    async def piece(self, delta: ChatDelta) -> None:
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
