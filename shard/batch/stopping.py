"""Why a request stops: EOS, a stop sequence in its text, or its token allowance."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    """Values match the proto's FinishReason enum, so a reason crosses gRPC as `int(reason)`."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


@dataclass
class StoppingCriteria:
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    stop_sequences: list[str]
    ignore_eos: bool = False
    generated_tokens: int = 0  # counts tokens seen by __call__
    # Length of the text already searched: searching only past it keeps each step O(new text), not O(all text).
    _searched: int = field(default=0, init=False, repr=False)

    def __call__(self, token_id: int, output_text: str) -> FinishReason | None:
        """Called once per generated token with the whole text generated so far (after this token). Returns why
        the request stops now, or None. EOS beats a stop sequence, and both beat the allowance running out,
        because they say more about why the text ended."""
        self.generated_tokens += 1
        if token_id in self.eos_token_ids and not self.ignore_eos:
            return FinishReason.EOS_TOKEN
        if self._new_stop_sequence(output_text):
            return FinishReason.STOP_SEQUENCE
        if self.generated_tokens >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _new_stop_sequence(self, text: str) -> bool:
        """A stop sequence that ends inside the text added since the last call. It may start up to len(stop) - 1
        characters earlier, since it can span tokens; one ending before that was already there last time."""
        searched, self._searched = self._searched, len(text)
        return any(stop and stop in text[max(0, searched - len(stop) + 1) :] for stop in self.stop_sequences)
