"""Mistral's tool calls (Mistral 7B v0.3, Mistral Nemo, Small, Large): `[TOOL_CALLS]` then a JSON list,
`[{"name": ..., "arguments": {...}}, ...]`, after any text. Call ids are 9 letters and digits: Mistral's chat
templates refuse any other id when the calls are sent back."""

from __future__ import annotations

from conveyor.router.pipeline.tool_parsers.calls import Framing
from conveyor.router.pipeline.tool_parsers.family import ToolFormat, nine_alphanumeric

MISTRAL = ToolFormat(
    name="mistral",
    framing=Framing(opens=("[TOOL_CALLS]",), bare_separator=","),
    markers=("[TOOL_CALLS]", "[AVAILABLE_TOOLS]"),
    model_types=("mistral",),
    new_id=nine_alphanumeric,
)
