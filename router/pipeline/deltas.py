"""`ChatDelta`: one piece of a chat answer as it is read out of the model's text, in order: reasoning, answer text, or
a piece of a tool call. The chat route turns these into OpenAI's chunks and messages
(router/frontends/openai_format.py); the reading itself is `chat_output.ChatOutput`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatDelta:
    """One piece of output. A tool call comes as pieces with its `call_index`: the first names it (`call_id`,
    `call_name`), each carries a piece of its JSON arguments (the first may carry none yet)."""

    reasoning: str = ""  # reasoning text (a <think> block's)
    content: str = ""  # answer text
    call_index: int | None = None  # a tool-call piece: which call (0, 1, ... in the order written)
    call_id: str | None = None  # set on the call's first piece
    call_name: str | None = None  # set on the call's first piece
    arguments: str = ""  # a piece of the call's JSON arguments

    @property
    def is_call(self) -> bool:
        return self.call_index is not None
