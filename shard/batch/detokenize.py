"""Incremental detokenization: one text piece per generated token, with multi-byte characters whole.

Byte-level tokenizers split a character's bytes across tokens, and many tokenizers decode a token differently
alone than after its left neighbours (a leading space is dropped, for one). Decoding a short window of left
context and emitting only what the new token adds to it, and only once that no longer ends in a replacement
character, solves both without re-decoding the whole output every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"  # what decoding gives for bytes that do not yet form a whole character
PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first generated tokens


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces so multi-byte characters come out whole."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0  # start of the context window decoded each step
        self.read_offset = len(self.ids)  # tokens before this one have had their text emitted
        self._text = ""

    def step(self, token_id: int) -> str:
        """Returns the new text this token completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        current = self._decode(self.ids[self.prefix_offset :])
        if len(current) <= len(emitted) or current.endswith(REPLACEMENT):
            return ""  # hold the bytes back until a later token completes the character
        piece = current[len(emitted) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._text += piece
        return piece

    @property
    def text(self) -> str:
        """All generated text so far (the sum of returned pieces)."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        """Special tokens keep their text, and no clean-up, so pieces add up to exactly what was generated."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
