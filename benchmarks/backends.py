"""What each kind of endpoint is sent, and how its streamed events are read.

Three API shapes: OpenAI completions, OpenAI chat completions, and TGI's `/generate_stream`. Each turns one
prompt into a request body and each parsed server-sent event into a `StreamEvent`: whether it carries a token,
and any token counts or error it reports. Servers that reject fields outside the OpenAI schema (`transformers
serve` answers 422) get only schema fields when `extra_fields` is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.workload import Prompt

BACKENDS = ("openai-completions", "openai-chat", "tgi")


@dataclass(frozen=True)
class RequestOptions:
    model: str
    ignore_eos: bool = False
    extra_fields: bool = True  # off: send only fields of the public API schema (no `ignore_eos`)
    speculate: int | None = None  # Conveyor's per-request cap on draft tokens (0: none), sent with extra fields


@dataclass(frozen=True)
class StreamEvent:
    token: bool = False  # a chunk that delivers generated content: it times TTFT and ITL
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


class Backend:
    name = ""
    path = ""

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, event: dict[str, Any]) -> StreamEvent:
        raise NotImplementedError


def _error_text(event: dict[str, Any]) -> str | None:
    """An in-stream error, in Conveyor's/TGI's shape (a string) or OpenAI's (an object with a message)."""
    error = event.get("error")
    if error is None:
        return None
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


class OpenAIBackend(Backend):
    """Greedy (temperature 0) streaming with `stream_options.include_usage`, so the server counts the tokens."""

    def _common(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        body = {
            "model": options.model,
            "max_tokens": prompt.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.ignore_eos and options.extra_fields:
            body["ignore_eos"] = True
        if options.speculate is not None and options.extra_fields:
            body["speculate"] = options.speculate
        return body

    def content(self, choice: dict[str, Any]) -> str:
        raise NotImplementedError

    def read(self, event: dict[str, Any]) -> StreamEvent:
        if (error := _error_text(event)) is not None:
            return StreamEvent(error=error)
        usage = event.get("usage") or {}
        choices = event.get("choices") or []
        text = self.content(choices[0]) if choices else ""
        # A chunk counts as a token when it carries text: chat's opening role-only chunk and the closing
        # finish/usage chunk (transformers serve's has empty text) carry none.
        return StreamEvent(bool(text), text, usage.get("prompt_tokens"), usage.get("completion_tokens"))


class CompletionsBackend(OpenAIBackend):
    name, path = "openai-completions", "/v1/completions"

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        return {**self._common(prompt, options), "prompt": prompt.text}

    def content(self, choice: dict[str, Any]) -> str:
        return choice.get("text") or ""


class ChatBackend(OpenAIBackend):
    name, path = "openai-chat", "/v1/chat/completions"

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        return {**self._common(prompt, options), "messages": [{"role": "user", "content": prompt.text}]}

    def content(self, choice: dict[str, Any]) -> str:
        return (choice.get("delta") or {}).get("content") or ""


class TGIBackend(Backend):
    """`/generate_stream`: one event per token; `details` makes the last event report the generated count."""

    name, path = "tgi", "/generate_stream"

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        parameters: dict[str, Any] = {"max_new_tokens": prompt.output_len, "details": True}
        if options.ignore_eos and options.extra_fields:
            parameters["ignore_eos"] = True
        if options.speculate is not None and options.extra_fields:
            parameters["speculate"] = options.speculate
        return {"inputs": prompt.text, "parameters": parameters}

    def read(self, event: dict[str, Any]) -> StreamEvent:
        if (error := _error_text(event)) is not None:
            return StreamEvent(error=error)
        token = event.get("token")
        details = event.get("details") or {}
        text = token.get("text", "") if isinstance(token, dict) else ""
        return StreamEvent(token is not None, text, None, details.get("generated_tokens"))


def backend(name: str) -> Backend:
    by_name = {b.name: b for b in (CompletionsBackend(), ChatBackend(), TGIBackend())}
    if name not in by_name:
        raise ValueError(f"unknown backend {name!r}; one of {', '.join(BACKENDS)}")
    return by_name[name]
