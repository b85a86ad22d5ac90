"""The JSON shapes of OpenAI's completions and chat completions answers and stream chunks (`/v1/completions`,
`/v1/chat/completions`): choices, logprobs, tool-call deltas, finish reasons and usage."""

from __future__ import annotations

import time
import uuid

from conveyor.router.api import openai as api
from conveyor.router.core.events import Finished, ScoredToken, TokenEvent
from conveyor.router.core.infer import Answer
from conveyor.router.frontends.replies import openai_logprob, token_text
from conveyor.router.pipeline.chat_output import ChatDelta
from conveyor.router.pipeline.openai_requests import Choice

FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> api.Usage:
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

    def response(self, results: list[tuple[Choice, Answer]], logprobs: bool) -> dict:
        body = self._envelope(self.object_name, [self.choice(c, r, logprobs) for c, r in results])
        body["usage"] = usage(
            sum(len(c.request.input_ids) for c, _ in results),
            sum(r.finished.generated_tokens for _, r in results),
            sum(r.finished.cached_tokens for _, r in results),
        )
        return body

    def usage_chunk(self, usage: api.Usage) -> dict:
        return {**self._envelope(self.chunk_name, []), "usage": usage}

    def opening(self, choices: list[Choice]) -> list[dict]:
        return []

    def choice(self, choice: Choice, response: Answer, logprobs: bool) -> dict:
        raise NotImplementedError

    def chunk(self, choice: Choice, event: TokenEvent, logprobs: bool) -> dict:
        raise NotImplementedError


def _finish_reason(finished: Finished | None) -> str | None:
    return None if finished is None else FINISH[finished.finish_reason]


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

    def choice(self, choice: Choice, response: Answer, logprobs: bool) -> api.CompletionChoice:
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
    def _entry(token: ScoredToken) -> api.LogprobEntry:
        return {"token": token.text, "logprob": openai_logprob(token), "bytes": list(token.text.encode())}

    def _logprobs(self, events: list[TokenEvent]) -> api.ChatLogprobs:
        return {
            "content": [
                {**self._entry(e.token), "top_logprobs": [self._entry(t) for t in e.top_tokens]} for e in events
            ]
        }

    def choice(self, choice: Choice, response: Answer, logprobs: bool) -> api.ChatChoice:
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


def _chat_delta(deltas: list[ChatDelta], plain: bool) -> api.Delta:
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


def _call_deltas(deltas: list[ChatDelta]) -> list[api.ToolCallDelta]:
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
