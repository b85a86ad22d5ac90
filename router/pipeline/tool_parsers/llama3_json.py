"""Llama 3.1-3.3's JSON tool calls: the answer is a call, `{"name": ..., "parameters": {...}}`, or several
separated by `;`, optionally after `<|python_tag|>`; an answer that does not start with one is text. The chat
template says so in words ("Respond in the format {"name": function name, "parameters": dictionary of argument
name and its value}"), which is how it is recognised."""

from __future__ import annotations

from conveyor.router.pipeline.tool_parsers.calls import Framing
from conveyor.router.pipeline.tool_parsers.family import ToolFormat

LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    framing=Framing(opens=("<|python_tag|>",), at_start="{", bare_separator=";"),
    markers=("<|python_tag|>", '"parameters": dictionary of argument name'),
    model_types=("llama",),
)
