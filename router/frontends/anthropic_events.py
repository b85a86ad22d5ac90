"""What Anthropic's Messages API answers: a finished chat output as the Message object (its content blocks, stop
reason and usage), and a streamed one as Anthropic's events, in the order its SDKs rebuild a message from
(`MessageEvents`). The reading of the output (reasoning, text, tool calls) is the chat route's, `ChatOutput`; here
are only Anthropic's shapes for it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from conveyor.router.api import anthropic as api
from conveyor.router.core.events import Finished
from conveyor.router.frontends.replies import anthropic_error_detail, failure_named, send_sse
from conveyor.router.pipeline.chat_output import ChatDelta, Parsed


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> api.MessageUsage:
    """Anthropic's usage: the prompt is `input_tokens` plus `cache_read_input_tokens` (the tokens the prefix cache
    served, memory or disk tier), as Anthropic counts a prompt read from its cache."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_of(finished: Finished, stops: Sequence[str], called: bool, whole: bool) -> tuple[api.StopReason, str | None]:
    """The stop reason, and the stop sequence the output ended with. An output that made its calls whole ends for
    them (`tool_use`) unless the token limit cut it; a call cut short is not answered as made."""
    if finished.finish_reason == "length":
        return "max_tokens", None
    if called and whole:
        return "tool_use", None
    if finished.finish_reason == "stop_sequence":
        return "stop_sequence", _matched(finished.generated_text, stops)
    return "end_turn", None


def _matched(text: str, stops: Sequence[str]) -> str | None:
    """The stop sequence that ended `text`: the first to appear in it (the output stops at the token that
    completes one, and its text keeps it, as on every Conveyor route)."""
    found = [(text.find(stop) + len(stop), stop) for stop in stops if stop in text]
    return min(found)[1] if found else None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as its `input`; empty if the output ended before they were whole."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def content_of(parsed: Parsed) -> list[api.ContentBlock]:
    """A whole output's blocks: its reasoning, its text (empty if nothing at all was said), its calls."""
    blocks: list[api.ContentBlock] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content is not None and (parsed.content or not parsed.calls):
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
    return blocks


def message(
    message_id: str,
    model: str,
    content: list[api.ContentBlock],
    stop: tuple[api.StopReason | None, str | None],
    usage_: api.MessageUsage,
) -> api.AnthropicMessage:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage_,
    }


_EMPTY_BLOCKS: dict[str, dict[str, Any]] = {
    "text": {"type": "text", "text": ""},
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
}


class MessageEvents:
    """Turns a stream's pieces into Anthropic's events: `message_start` and a `ping`, then each content block
    (thinking, text, each tool call) opened, added to and stopped in order, then `message_delta` with the stop
    reason and the usage, and `message_stop`."""

    def __init__(self, sse: web.StreamResponse, start: api.AnthropicMessage) -> None:
        self.sse, self.start_message = sse, start
        self.index = -1  # the block receiving pieces now (-1: none yet)
        self.open: str | None = None  # its type, while it is open

    async def send(self, kind: str, **fields: Any) -> None:
        await send_sse(self.sse, {"type": kind, **fields}, kind)

    async def start(self) -> None:
        await self.send("message_start", message=self.start_message)
        await self.send("ping")

    async def piece(self, delta: ChatDelta) -> None:
        if delta.reasoning:
            await self._block("thinking")
            await self._delta({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            await self._block("text")
            await self._delta({"type": "text_delta", "text": delta.content})
        if delta.call_index is None:
            return
        if delta.call_id is not None:
            block = {"type": "tool_use", "id": delta.call_id, "name": delta.call_name or "", "input": {}}
            await self._open("tool_use", block)
        if delta.arguments and self.open == "tool_use":
            await self._delta({"type": "input_json_delta", "partial_json": delta.arguments})

    async def finish(self, stop: tuple[api.StopReason, str | None], usage_: api.MessageUsage) -> None:
        if self.index < 0:  # nothing at all was said: an empty text block, as the whole message has
            await self._block("text")
        await self._close()
        await self.send("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=usage_)
        await self.send("message_stop")

    async def fail(self, message_: str, error_type: str) -> None:
        """A stream that failed after its 200 went out ends with Anthropic's `error` event."""
        await self.send("error", error=anthropic_error_detail(failure_named(error_type).status, message_))

    async def _block(self, kind: str) -> None:
        if self.open != kind:
            await self._open(kind, dict(_EMPTY_BLOCKS[kind]))

    async def _open(self, kind: str, block: dict[str, Any]) -> None:
        await self._close()
        self.index += 1
        self.open = kind
        await self.send("content_block_start", index=self.index, content_block=block)

    async def _delta(self, delta: dict[str, Any]) -> None:
        await self.send("content_block_delta", index=self.index, delta=delta)

    async def _close(self) -> None:
        if self.open is not None:
            self.open = None
            await self.send("content_block_stop", index=self.index)
