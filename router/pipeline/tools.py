"""Tool calls on `/v1/chat/completions`: reading `tools` and `tool_choice`, and the grammars of forced calls. Reading
calls out of the output is the tool-call parsers' (tool_parsers/, through chat_output.py).

- `tool_choice: "none"` (or no tools): a plain chat; the tools are not shown to the model.
- `"auto"` (the default with tools): the tools go through the chat template and the model writes what it likes;
  calls are read from its output in the format of the model's family (`hermes`, `llama3_json`, `mistral`,
  `phi4_mini_json`).
- `"required"`: a grammar forces a JSON list of calls `[{"name": ..., "arguments": {...}}]` (one call unless
  `parallel_tool_calls`), each call's arguments fitting its function's parameter schema, whatever the family.
- a named function: a grammar forces that function's arguments, as one JSON object.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.grammar import Constraint
from conveyor.router.api.base import ValidationError
from conveyor.router.api.constraints import build
from conveyor.router.api.openai import ChatRequest

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolSchema:
    name: str
    parameters: dict[str, Any]  # the JSON schema of its arguments
    spec: dict[str, Any]  # the tool as the client sent it, for the chat template


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry; streaming deltas carry an `index` as well."""
        entry: dict[str, Any] = {"id": self.id, "type": "function"}
        entry["function"] = {"name": self.name, "arguments": self.arguments}
        return entry if index is None else {"index": index, **entry}


def whole_arguments(arguments: str) -> bool:
    """Whether a call's arguments are whole JSON, so that it may be answered as a call made (`tool_calls`, a
    completed item). They are a JSON object (a forced `required` answer a list), and what a token limit or a stop
    sequence leaves of one is a prefix that never parses."""
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: JSON text nested thousands deep
        return False
    return True


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what the model may do with them."""

    tools: tuple[ToolSchema, ...]
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

    def _tool(self, name: str | None) -> ToolSchema:
        return next(t for t in self.tools if t.name == name)


def tool_use(request: ChatRequest) -> ToolUse | None:
    """The tools of a chat request and what the model may do with them; None when the model gets none. The
    schema checked each tool's shape; what it cannot say of a list is checked here."""
    if not request.tools or request.tool_choice == "none":
        return None
    tools = tuple(
        ToolSchema(t.function.name, t.function.parameters or ANY_OBJECT, t.model_dump(exclude_unset=True))
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
