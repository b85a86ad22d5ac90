"""Reasoning: models that think in a `<think>...</think>` block before they answer (Qwen3, DeepSeek-R1 and their
kin) get that block back apart from the answer, as `reasoning_content`.

Where a request's output starts is read from the end of its rendered prompt (`Reasoning.of_prompt`), not from the
parser's name: a template may open the block itself (DeepSeek-R1's, Qwen3's thinking-only checkpoints': the
output starts inside it), close it at once (Qwen3's with `enable_thinking: false`: the output is all answer), or
leave the model to open it (Qwen3's by default). A constraint (structured output, a forced tool call) applies to
the answer after the block, so its grammar gets the block in front of it (`Reasoning.constrain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from conveyor.grammar import Constraint

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; both read a <think> block, however the prompt left it
Start = Literal["free", "inside", "closed"]
Piece = tuple[Literal["reasoning", "answer"], str]


@dataclass(frozen=True)
class Reasoning:
    """How one request's output stands to the reasoning block: the model may open one (`free`), is inside the one
    its prompt opened (`inside`), or past the one its prompt closed (`closed`)."""

    start: Start

    @classmethod
    def of_prompt(cls, prompt: str) -> Reasoning:
        tail = prompt.rstrip()
        if tail.endswith(THINK_OPEN):
            return cls("inside")
        return cls("closed" if tail.endswith(THINK_CLOSE) else "free")

    def constrain(self, constraint: Constraint | None) -> Constraint | None:
        """The constraint of the answer, with the reasoning block allowed (or, inside one, required) before it. A
        regex, choice or grammar that writes `</think>` itself shapes the reasoning too: it applies as it is."""
        if constraint is None or self.start == "closed":
            return constraint
        if constraint.kind in ("regex", "choice", "grammar") and THINK_CLOSE in constraint.value:
            return constraint
        return constraint.after_reasoning(THINK_OPEN if self.start == "free" else "", THINK_CLOSE)

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.start)


class ReasoningSplitter:
    """One choice's text split into reasoning and answer as it arrives. The block's tags are dropped, and so is
    the whitespace at the block's ends and between it and the answer."""

    def __init__(self, start: Start) -> None:
        self.state = {"free": "before", "inside": "thinking", "closed": "answer"}[start]
        self.buffer = ""
        self.fresh = True  # at the block's start: leading whitespace is dropped

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        steps = {"before": self._before, "thinking": self._thinking, "after": self._after, "answer": self._answer}
        while self.buffer and steps[self.state](pieces, final):
            pass
        return [(kind, text) for kind, text in pieces if text]

    def _before(self, pieces: list[Piece], final: bool) -> bool:
        """The output's start: a block opens here, or the output is all answer."""
        stripped = self.buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.buffer, self.state = stripped[len(THINK_OPEN) :], "thinking"
            return True
        if THINK_OPEN.startswith(stripped) and not final:
            return False
        self.state = "answer"
        return True

    def _thinking(self, pieces: list[Piece], final: bool) -> bool:
        if self.fresh:
            self.buffer = self.buffer.lstrip()
            self.fresh = not self.buffer
        end = self.buffer.find(THINK_CLOSE)
        if end >= 0:
            pieces.append(("reasoning", self.buffer[:end].rstrip()))
            self.buffer, self.state = self.buffer[end + len(THINK_CLOSE) :], "after"
            return True
        safe = len(self.buffer) if final else _safe_end(self.buffer, THINK_CLOSE)
        text = self.buffer[:safe]
        kept = text if not final else text.rstrip()
        pieces.append(("reasoning", kept))
        self.buffer = self.buffer[safe:] if not final else ""
        return False

    def _after(self, pieces: list[Piece], final: bool) -> bool:
        self.buffer = self.buffer.lstrip()
        if self.buffer:
            self.state = "answer"
        return bool(self.buffer)

    def _answer(self, pieces: list[Piece], final: bool) -> bool:
        pieces.append(("answer", self.buffer))
        self.buffer = ""
        return False


def _safe_end(text: str, tag: str) -> int:
    """Where the reasoning that can be given out now ends: not within what may be the start of the closing tag,
    nor within trailing whitespace (dropped if the tag follows)."""
    end = len(text)
    for keep in range(min(len(tag) - 1, end), 0, -1):
        if tag.startswith(text[end - keep :]):
            end -= keep
            break
    return len(text[:end].rstrip())
