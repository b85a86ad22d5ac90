"""`ToolFormat`: what one model family's tool calls look like, for reading them (`Framing`), for choosing the family
from a model (the chat template's markers, config.json's `model_type`), and for naming its calls (the ids its chat
template accepts back)."""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.router.pipeline.tool_parsers.calls import CallReader, Framing
from conveyor.router.pipeline.tools import ToolUse


def openai_id() -> str:
    """OpenAI's shape: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


ALPHANUMERIC = string.ascii_letters + string.digits


def nine_alphanumeric() -> str:
    """Mistral's rule: its chat templates refuse a call id that is not 9 letters and digits when the call is sent
    back in the next request."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


@dataclass(frozen=True)
class ToolFormat:
    name: str  # vLLM's name for the parser (--tool-call-parser)
    framing: Framing
    markers: tuple[str, ...]  # text in a chat template that teaches (or renders) this format
    model_types: tuple[str, ...] = ()  # config.json's model_type, to break a tie between templates' markers
    new_id: Callable[[], str] = openai_id

    def reader(self, tools: ToolUse) -> CallReader:
        """Reads one choice's answer for calls to `tools` (tool_choice auto)."""
        return CallReader(tools, self.framing, self.new_id)
