"""Incremental detokenization on the tiny model's byte-level tokenizer: whole characters, exact text."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.shard.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("text", ["héllo 世界 ok", "  leading spaces\tand tabs\n", "emoji 🚂 train, ünïcödé"])
def test_pieces_are_whole_characters_and_add_up_to_the_text(tokenizer, text: str) -> None:
    prompt = tokenizer("def f():").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.split())  # multi-byte characters really are split across tokens here
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text
    assert "".join(pieces) == tokenizer.decode(ids)


def test_an_incomplete_character_waits_for_its_last_byte(tokenizer) -> None:
    ids = tokenizer("世", add_special_tokens=False).input_ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [0])
    pieces = [detok.step(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "世"
