"""One streamed request, timed as vLLM's benchmark times it, and the server-sent-event reader it needs.

The clock starts just before the POST. TTFT is the first chunk that carries content, each ITL the gap between
two successive content chunks (per chunk, not per token), E2EL the time to the last content chunk. The output
length is the server's own count (`usage.completion_tokens`, or TGI's `details.generated_tokens`); without one,
the generated text is re-tokenized when a tokenizer is at hand, and content chunks are counted otherwise.
A request that fails in any way comes back with `success` False and the reason: it is never dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.backends import Backend, RequestOptions
from benchmarks.workload import Prompt

ERROR_BODY_CHARS = 300


@dataclass
class RequestRecord:
    index: int  # the prompt's index in the workload
    prompt_len: int  # the server's count when it reports one, the workload's otherwise
    output_len: int = 0
    success: bool = False
    error: str | None = None
    sent_at: float = 0.0  # seconds after the run started
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for one-token outputs."""
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "success": self.success,
            "error": self.error,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "sent_at_s": self.sent_at,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2el_s": self.e2el,
            "itl_s": self.itl,
        }


async def sse_data(content: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The `data` payload of each server-sent event, until `[DONE]` or the end of the body (`transformers serve`
    sends no `[DONE]`). Multi-line data is joined with newlines; comments and other fields are skipped.
    `content` yields lines, as aiohttp's response body does when iterated."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line:
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
            continue
        if data:
            payload, data = "\n".join(data), []
            if payload == "[DONE]":
                return
            yield payload
    if data and (payload := "\n".join(data)) != "[DONE]":
        yield payload


@dataclass
class _Stream:
    """What one response's events add up to while they arrive."""

    start: float
    last: float = 0.0
    chunks: int = 0
    text: list[str] = field(default_factory=list)
    completion_tokens: int | None = None


async def send(
    session: aiohttp.ClientSession,
    url: str,
    backend: Backend,
    prompt: Prompt,
    options: RequestOptions,
    tokenizer: Any = None,
    run_start: float = 0.0,
) -> RequestRecord:
    record = RequestRecord(prompt.index, prompt.prompt_len)
    body = backend.body(prompt, options)
    stream = _Stream(time.perf_counter())
    record.sent_at = stream.start - run_start
    try:
        async with session.post(url + backend.path, json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:ERROR_BODY_CHARS]}"
                return record
            async for payload in sse_data(response.content):
                if (error := _take(backend, json.loads(payload), stream, record)) is not None:
                    record.error = error
                    return record
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: bad JSON or UTF-8
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    return _finish(record, stream, tokenizer)


def _take(backend: Backend, raw: dict[str, Any], stream: _Stream, record: RequestRecord) -> str | None:
    """Folds one event into the stream's tallies; returns the error it reports, if any."""
    event = backend.read(raw)
    if event.error is not None:
        return event.error
    if event.prompt_tokens is not None:
        record.prompt_len = event.prompt_tokens
    if event.completion_tokens is not None:
        stream.completion_tokens = event.completion_tokens
    if event.token:
        now = time.perf_counter()
        if stream.chunks == 0:
            record.ttft = now - stream.start
        else:
            record.itl.append(now - stream.last)
        stream.last, stream.chunks = now, stream.chunks + 1
        stream.text.append(event.text)
    return None


def _finish(record: RequestRecord, stream: _Stream, tokenizer: Any) -> RequestRecord:
    if stream.chunks == 0:
        record.error = "the stream ended without any content"
        return record
    record.e2el = stream.last - stream.start
    if stream.completion_tokens is not None:
        record.output_len = stream.completion_tokens
    elif tokenizer is not None:
        record.output_len = len(tokenizer("".join(stream.text), add_special_tokens=False).input_ids)
    else:
        record.output_len = stream.chunks
    record.success = True
    return record
