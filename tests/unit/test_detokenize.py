"""Incremental detokenization on the tiny model's byte-level tokenizer: whole characters, exact text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from conveyor import demo_model
from conveyor.shard.batch.detokenize import IncrementalDetokenizer

ALPHABET = list("abcdefghij  \n\t.,:()") + ["é", "ü", "ß", "世", "界", "€", "🚂", "ok", " the", "def "]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model.ensure(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def stream(tokenizer: PreTrainedTokenizerBase, ids: list[int], prompt: str = "def f():") -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer(prompt).input_ids)
    pieces = [detok.step(i) for i in ids]
    assert detok.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("text", ["héllo 世界 ok", "  leading spaces\tand tabs\n", "emoji 🚂 train, ünïcödé"])
def test_pieces_are_whole_characters_and_add_up_to_the_text(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = encode(tokenizer, text)
    assert len(ids) > len(text.split())  # multi-byte characters really are split across tokens here
    pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tokenizer.decode(ids)


def test_an_incomplete_character_waits_for_its_last_byte(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "世")
    assert len(ids) > 1
    pieces = stream(tokenizer, ids, prompt="x")
    assert pieces == [""] * (len(ids) - 1) + ["世"]


def test_a_leading_space_is_kept_after_the_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, " ok then")
    assert stream(tokenizer, ids)[0].startswith(" ")
    assert "".join(stream(tokenizer, ids)) == " ok then"


def test_an_empty_prompt_needs_no_context(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.step(i) for i in encode(tokenizer, "ça va")) == "ça va" == detok.text


def test_special_tokens_come_out_as_their_text(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "done") + [tokenizer.eos_token_id]
    assert stream(tokenizer, ids)[-1] == tokenizer.eos_token


@pytest.mark.parametrize("seed", range(5))
def test_random_valid_text_streams_exactly(tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(80))
    ids = encode(tokenizer, text)
    pieces = stream(tokenizer, ids, prompt=rng.choice(["", "x", "世界", "def f():\n    return"]))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
