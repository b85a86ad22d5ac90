"""Which reader a chat answer gets, by what the request lets the model do with its tools: none (plain text), `auto`
(the family's format), or a forced call. A forced call's output is the JSON its grammar forces (tools.py), the
same for every family: `required` a list `[{"name": ..., "arguments": {...}}, ...]`, a named function its
arguments alone. Its ids follow the family's rule all the same (Mistral's templates check them)."""

from __future__ import annotations

from typing import Protocol

from conveyor.router.pipeline.deltas import ChatDelta
from conveyor.router.pipeline.tool_parsers.calls import CallReader, Framing
from conveyor.router.pipeline.tool_parsers.family import ToolFormat
from conveyor.router.pipeline.tools import ToolUse

FORCED_LIST = Framing(at_start="[")


class AnswerReader(Protocol):
    def feed(self, text: str, final: bool = False) -> list[ChatDelta]:
        """The pieces `text` completes; `final`: no more text comes, so what is unfinished is not a call."""
        ...


class PlainReader:
    """No tools: the answer is content, as it comes."""

    def feed(self, text: str, final: bool = False) -> list[ChatDelta]:
        return [ChatDelta(content=text)] if text else []


class NamedReader:
    """A named function forced: the answer is that call's arguments, streamed as they are written."""

    def __init__(self, name: str, call_id: str) -> None:
        self.name = name
        self.call_id = call_id
        self.started = False

    def feed(self, text: str, final: bool = False) -> list[ChatDelta]:
        if not text:
            return []
        if self.started:
            return [ChatDelta(call_index=0, arguments=text)]
        self.started = True
        return [ChatDelta(call_index=0, call_id=self.call_id, call_name=self.name, arguments=text)]


def answer_reader(tools: ToolUse | None, family: ToolFormat) -> AnswerReader:
    if tools is None:
        return PlainReader()
    if tools.choice == "named":
        return NamedReader(tools.name or "", family.new_id())
    if tools.choice == "required":
        return CallReader(tools, FORCED_LIST, family.new_id)
    return family.reader(tools)
