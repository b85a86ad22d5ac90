"""Incremental detokenization: text pieces that come out whole, one per generated token.

Byte-level tokenizers split multi-byte characters across tokens, and many tokenizers decode a token
differently alone than after its left neighbours (leading spaces). Decoding a short window of context and
emitting only what it adds, and only once it no longer ends in a replacement character, solves both.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.ids)  # tokens before this are already emitted
        self._text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """The text this token completes; "" while a character is still incomplete."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        piece = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._text += piece
        return piece

    @property
    def text(self) -> str:
        return self._text
