"""Why a request stops: EOS, a stop sequence in its text, or its token allowance."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    """Values match the proto's FinishReason enum."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


@dataclass
class StoppingCriteria:
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    generated_tokens: int = 0
    _checked_len: int = 0  # text length already searched for stop sequences

    def __call__(self, token_id: int, output_text: str) -> FinishReason | None:
        """Called once per generated token with all the text generated so far, this token's included.

        Only the new tail is searched, reaching back far enough that a stop sequence spanning several tokens
        is still found once, when its last character arrives.
        """
        self.generated_tokens += 1
        if token_id in self.eos_token_ids and not self.ignore_eos:
            return FinishReason.EOS_TOKEN
        if self._stop_sequence_in(output_text):
            return FinishReason.STOP_SEQUENCE
        if self.generated_tokens >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _stop_sequence_in(self, text: str) -> bool:
        found = False
        for stop in self.stop_sequences:
            start = max(0, self._checked_len - len(stop) + 1)
            if stop in text[start:]:
                found = True
                break
        self._checked_len = len(text)
        return found
