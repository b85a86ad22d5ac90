"""Phi-4-mini's tool calls: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>`, the special
tokens Phi-4-mini's tokenizer has for them and the format its model card shows (its chat template itself only
lists the tools, between `<|tool|>` and `<|/tool|>`, which is how it is recognised). vLLM's `phi4_mini_json`
reads `functools[...]` instead, the format of a system prompt Microsoft's Phi Cookbook suggests; both are read.
The closing token is optional (the model often stops without it), and so are the list's brackets."""

from __future__ import annotations

from conveyor.router.pipeline.tool_parsers.calls import Framing
from conveyor.router.pipeline.tool_parsers.family import ToolFormat

PHI4_MINI_JSON = ToolFormat(
    name="phi4_mini_json",
    framing=Framing(opens=("<|tool_call|>", "functools"), bare_separator=",", closes=("<|/tool_call|>",)),
    markers=("<|tool_call|>", "<|tool|>"),
    model_types=("phi3",),
)
