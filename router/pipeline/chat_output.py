"""`ChatOutput`: one choice's model text read as a chat answer, in order: its reasoning, its answer text and its
tool calls, streamed (`feed` each piece of text, then `finish`) or whole (`parse`). Every chat-shaped route
builds on it (the chat route's chunks and message: router/frontends/openai_format.py); it knows no API's shapes.

The reading is in two stages: the reasoning block is split off first (reasoning.py, when the model reasons), and
what follows it, the answer, goes to the reader the request's tools call for (tool_parsers/readers.py). So tool
calls are read from the answer only, never from inside the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.router.pipeline.deltas import ChatDelta
from conveyor.router.pipeline.reasoning import Piece, Reasoning
from conveyor.router.pipeline.tool_parsers.family import ToolFormat
from conveyor.router.pipeline.tool_parsers.readers import answer_reader
from conveyor.router.pipeline.tool_parsers.registry import FALLBACK
from conveyor.router.pipeline.tools import ParsedCall, ToolUse, whole_arguments

__all__ = ["ChatOutput", "ChatDelta", "Parsed"]


@dataclass(frozen=True)
class Parsed:
    """A whole answer. `content` is None when the answer is only calls or reasoning (or nothing after a reasoning
    block: the token limit met inside it); `reasoning` is None when there was none."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)
    whole: bool = True  # no call was cut short (`ChatOutput.whole`)

    @classmethod
    def of(cls, deltas: list[ChatDelta], whole: bool = True) -> Parsed:
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        calls = _calls(deltas)
        empty = not content and bool(calls or reasoning)
        return cls(reasoning or None, None if empty else content, calls, whole)


class ChatOutput:
    """One choice's output: `tools` as the request gave them (None: no tools), `reasoning` how its output stands
    to a reasoning block (None: the model does not reason), `family` the served model's tool-call format."""

    def __init__(
        self, tools: ToolUse | None, reasoning: Reasoning | None = None, family: ToolFormat = FALLBACK
    ) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.family = family
        self.splitter = reasoning.splitter() if reasoning is not None else None
        self.reader = answer_reader(tools, family)
        self.called = False  # a call has begun in the stream (it ends for tool calls)
        self.answer = ""  # the answer read so far (what follows any reasoning)
        self.arguments: dict[int, str] = {}  # each call's arguments read so far, by call index

    def feed(self, text: str) -> list[ChatDelta]:
        """The pieces this text completes (none while it may still be the start of a marker)."""
        pieces = self.splitter.feed(text) if self.splitter is not None else [("answer", text)]
        return self._seen(self._read(pieces))

    def finish(self) -> list[ChatDelta]:
        """The pieces still owed once the output is complete."""
        pieces = self.splitter.finish() if self.splitter is not None else []
        return self._seen(self._read(pieces) + self.reader.feed("", final=True))

    def parse(self, text: str) -> Parsed:
        """The whole output `text` as one answer (a fresh reading: this object's stream is not touched). Equal to
        what `feed` and `finish` add up to, but for a call a stream had begun when its JSON broke off."""
        fresh = self.fresh()
        pieces = fresh.splitter.feed(text) + fresh.splitter.finish() if fresh.splitter else [("answer", text)]
        deltas = [ChatDelta(reasoning=t) for kind, t in pieces if kind == "reasoning"]
        fresh.answer = "".join(t for kind, t in pieces if kind == "answer")
        deltas += fresh._seen(fresh.reader.feed(fresh.answer, final=True))
        return Parsed.of(deltas, fresh.whole())

    def whole(self) -> bool:
        """Whether the output read so far holds no call cut short, by the token limit or a stop sequence: a forced
        call's answer is the JSON its grammar writes (tools.py), and every call's arguments are JSON. A call cut
        short is not a call made: the routes answer it as cut (`stop` or `length`, an incomplete response)."""
        forced = self.tools is not None and self.tools.choice in ("named", "required")
        calls = all(whole_arguments(a) for a in self.arguments.values())
        return calls and (not forced or whole_arguments(self.answer))

    def fresh(self) -> ChatOutput:
        """A new reader of the same kind (same tools, reasoning start and family), at the output's start."""
        return ChatOutput(self.tools, self.reasoning, self.family)

    def _seen(self, deltas: list[ChatDelta]) -> list[ChatDelta]:
        self.called = self.called or any(d.call_id is not None for d in deltas)
        for d in deltas:
            if d.call_index is not None:
                self.arguments[d.call_index] = self.arguments.get(d.call_index, "") + d.arguments
        return deltas

    def _read(self, pieces: list[Piece]) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        for kind, text in pieces:
            self.answer += text if kind == "answer" else ""
            out += [ChatDelta(reasoning=text)] if kind == "reasoning" else self.reader.feed(text)
        return out


def _calls(deltas: list[ChatDelta]) -> list[ParsedCall]:
    """The calls the pieces add up to, in index order: the first piece names each, all add to its arguments."""
    named: dict[int, tuple[str, str]] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.call_index is None:
            continue
        if d.call_id is not None:
            named[d.call_index] = (d.call_id, d.call_name or "")
        arguments[d.call_index] = arguments.get(d.call_index, "") + d.arguments
    return [ParsedCall(named[i][1], arguments[i], named[i][0]) for i in sorted(named)]
