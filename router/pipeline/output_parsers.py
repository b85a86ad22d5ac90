"""The served model's output formats, chosen once at start: how it writes tool calls and whether it reasons in a
`<think>` block. The router reads them from the model directory (config.json's `model_type`) and its chat
template, unless `--tool-call-parser` or `--reasoning-parser` says."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.router.pipeline.chat_output import ChatOutput
from conveyor.router.pipeline.reasoning import REASONING_PARSERS, THINK_OPEN, Reasoning
from conveyor.router.pipeline.tool_parsers.family import ToolFormat
from conveyor.router.pipeline.tool_parsers.registry import FALLBACK, choose_tool_format
from conveyor.router.pipeline.tools import ToolUse

NO_REASONING = "none"


@dataclass(frozen=True)
class OutputParsers:
    tool_format: ToolFormat = FALLBACK
    reasoning: str | None = None  # the reasoning parser's name; None: the model does not reason

    def reasoning_of(self, prompt: str) -> Reasoning | None:
        """How a request's output stands to the reasoning block, from its rendered prompt (None: no reasoning)."""
        return Reasoning.of_prompt(prompt) if self.reasoning is not None else None

    def output(self, tools: ToolUse | None, reasoning: Reasoning | None) -> ChatOutput:
        """One choice's reader."""
        return ChatOutput(tools, reasoning, self.tool_format)


def output_parsers(
    model_dir: str | None, tokenizer: Any, tool_parser: str | None = None, reasoning_parser: str | None = None
) -> OutputParsers:
    """The flags where given; else the tool-call format the template teaches, and reasoning on where the template
    writes `<think>`."""
    template = chat_template(tokenizer)
    tool_format = choose_tool_format(template, model_type(model_dir), tool_parser)
    if reasoning_parser is None:
        reasoning = REASONING_PARSERS[0] if THINK_OPEN in template else None
    else:
        reasoning = None if reasoning_parser == NO_REASONING else reasoning_parser
    return OutputParsers(tool_format, reasoning)


def chat_template(tokenizer: Any) -> str:
    """The tokenizer's chat template(s) as one text (a tokenizer may hold several, by name)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def model_type(model_dir: str | None) -> str | None:
    """config.json's `model_type`, if the directory has one."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None
