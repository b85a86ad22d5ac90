"""Hermes' format, which Qwen 2.5, Qwen3, Hermes and most open chat templates teach (and the demo model's does):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call per block, as many blocks as calls, text
before them. Also the fallback for a model whose template names no format."""

from __future__ import annotations

from conveyor.router.pipeline.tool_parsers.calls import Framing
from conveyor.router.pipeline.tool_parsers.family import ToolFormat

HERMES = ToolFormat(
    name="hermes",
    framing=Framing(opens=("<tool_call>",), bare_separator="", closes=("</tool_call>",)),
    markers=("<tool_call>",),
    model_types=("qwen2", "qwen3"),
)
