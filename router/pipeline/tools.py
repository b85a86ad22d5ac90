"""Tool calls on `/v1/chat/completions`: reading `tools` and `tool_choice`, and reading calls out of the output.

- `tool_choice: "none"` (or no tools): a plain chat; the tools are not shown to the model.
- `"auto"` (the default with tools): the tools go through the chat template and the model writes what it likes;
  calls are read from its output in the Hermes format that most open chat templates teach (and the demo model's
  does): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `"required"`: a grammar forces a JSON list of calls `[{"name": ..., "arguments": {...}}]` (one call unless
  `parallel_tool_calls`), each call's arguments fitting its function's parameter schema.
- a named function: a grammar forces that function's arguments, as one JSON object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.grammar import Constraint
from conveyor.router.api.base import ValidationError
from conveyor.router.api.constraints import build
from conveyor.router.api.openai import ChatRequest

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # the JSON schema of its arguments
    spec: dict[str, Any]  # the tool as the client sent it, for the chat template


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry; streaming deltas carry an `index` as well."""
        entry: dict[str, Any] = {"id": self.id, "type": "function"}
        entry["function"] = {"name": self.name, "arguments": self.arguments}
        return entry if index is None else {"index": index, **entry}


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what the model may do with them."""

    tools: tuple[Tool, ...]
    choice: str  # auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.spec for t in self.tools]

    def constraint(self) -> Constraint | None:
        """The grammar that forces `required` or a named function, checked as any request's constraint is."""
        if self.choice == "named":
            return build("json_schema", self._tool(self.name).parameters, f"tools.{self.name}.parameters")
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"],
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return build("json_schema", schema, "tools")
        return None

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message content and the calls in a finished output. Output that is not a call stays content."""
        if self.choice == "named":
            return None, [ToolCall(self.name or "", text)]
        if self.choice == "required":
            try:
                calls = json.loads(text)
                return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
            except (ValueError, TypeError, KeyError, RecursionError):  # cut short by the token limit, or too deep
                return text, []
        rest, calls = self.split(text)
        content = rest.strip() if calls else text
        return (content or None), calls

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """Auto mode: the text less its Hermes call blocks (whitespace kept), and the calls. A block that is not a
        call to one of these tools stays in the text."""
        calls: list[ToolCall] = []
        kept: list[str] = []
        position = 0
        for match in _CALL.finditer(text):
            call = self._hermes_call(match.group(1))
            if call is None:
                continue
            kept.append(text[position : match.start()])
            position = match.end()
            calls.append(call)
        kept.append(text[position:])
        return "".join(kept), calls

    def _hermes_call(self, payload: str) -> ToolCall | None:
        try:
            call = json.loads(payload)
        except (ValueError, RecursionError):  # RecursionError: a payload nested thousands deep
            return None
        if not isinstance(call, dict) or call.get("name") not in {t.name for t in self.tools}:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def tool_use(request: ChatRequest) -> ToolUse | None:
    """The tools of a chat request and what the model may do with them; None when the model gets none. The
    schema checked each tool's shape; what it cannot say of a list is checked here."""
    if not request.tools or request.tool_choice == "none":
        return None
    tools = tuple(
        Tool(t.function.name, t.function.parameters or ANY_OBJECT, t.model_dump(exclude_unset=True))
        for t in request.tools
    )
    names = {t.name for t in tools}
    if len(names) < len(tools):
        raise ValidationError("`tools` has two functions of the same name")
    choice = request.tool_choice
    parallel = request.parallel_tool_calls
    if choice is None or choice == "auto" or choice == "required":
        return ToolUse(tools, choice or "auto", parallel=parallel)
    if choice.function.name not in names:
        raise ValidationError(f"`tool_choice` names the function `{choice.function.name}`, which is not in `tools`")
    return ToolUse(tools, "named", name=choice.function.name, parallel=parallel)


class ToolStream:
    """Turns one streamed choice's text into OpenAI deltas. A named call streams its arguments as they come; a
    required list is sent whole at the end (its items are only known once parsed); auto streams content until a
    call may be starting, and sends the calls at the end."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""
        self.sent_content = ""
        self.named_call: ToolCall | None = None
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> dict[str, Any]:
        self.text += text
        if self.use.choice == "named":
            if self.named_call is None:
                self.named_call = ToolCall(self.use.name or "", text)
                return {"tool_calls": [self.named_call.message(0)]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if self.use.choice == "auto":
            return self._content(self._safe_content())
        return {}

    def finish(self) -> dict[str, Any]:
        """The deltas still owed once the output is complete; `calls` then says whether any call was made."""
        if self.use.choice == "named":
            self.calls = [self.named_call] if self.named_call else []
            return {}
        if self.use.choice == "auto":
            # What follows the content already sent, less trailing whitespace: the message `parse` gives, but for
            # leading whitespace, which was sent before any call could be seen (stripping the whole text there
            # once kept anything after a call from being sent at all).
            rest, self.calls = self.use.split(self.text)
            delta = self._content(rest.rstrip() if self.calls else self.text)
        else:
            content, self.calls = self.use.parse(self.text)
            delta = self._content(content or "")
        if self.calls:
            delta["tool_calls"] = [call.message(i) for i, call in enumerate(self.calls)]
        return delta

    def _safe_content(self) -> str:
        """The text before any call, less a tail that may be the start of `<tool_call>`."""
        start = self.text.find(CALL_OPEN)
        if start >= 0:
            return self.text[:start]
        for keep in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):
            if CALL_OPEN.startswith(self.text[-keep:]):
                return self.text[:-keep]
        return self.text

    def _content(self, content: str) -> dict[str, Any]:
        """A content delta with what `content` adds to what was sent (nothing if it does not extend it)."""
        if not content.startswith(self.sent_content) or len(content) == len(self.sent_content):
            return {}
        new = content[len(self.sent_content) :]
        self.sent_content = content
        return {"content": new}
