"""The shard's token masks (`shard/sampling/masks.py`) against llguidance's own matcher, on the tiny model's
tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from conveyor.grammar import Constraint, GrammarCache
from conveyor.shard.sampling.masks import Masks


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def grammars(tiny_model: Path, tokenizer) -> GrammarCache:
    return GrammarCache(
        tokenizer, AutoConfig.from_pretrained(tiny_model).vocab_size, frozenset([tokenizer.eos_token_id])
    )


def _accepts(matcher, token: int) -> bool:
    probe = matcher.deep_copy()
    return probe.consume_token(token) and not probe.is_error()


def test_mask_allows_exactly_what_the_matcher_accepts(grammars: GrammarCache, tokenizer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]}
    matcher = grammars.matcher(Constraint.json_schema(schema).grammar)
    for text in ('{"', "n", '": ', "4"):
        logits = torch.zeros(1, grammars.vocab_size)
        Masks(frozenset([tokenizer.eos_token_id])).apply(logits, [matcher])
        allowed = set(torch.isfinite(logits[0]).nonzero().view(-1).tolist())
        assert allowed == {t for t in range(grammars.vocab_size) if _accepts(matcher, t)}
        assert allowed, "a live grammar always allows something"
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.consume_token(token)


def test_unconstrained_rows_are_untouched_and_a_broken_matcher_gets_eos(grammars: GrammarCache, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    broken = grammars.matcher(Constraint.regex("[0-9]+").grammar)
    broken.consume_token(tokenizer.encode("a", add_special_tokens=False)[0])  # refused: the matcher is in error
    assert broken.is_error()
    live = grammars.matcher(Constraint.regex("[0-9]+").grammar)
    logits = torch.randn(3, grammars.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    spent = Masks(frozenset([eos])).apply(logits, [broken, None, live])
    assert spent > 0
    assert torch.isfinite(logits[0]).nonzero().view(-1).tolist() == [eos]
    assert torch.equal(logits[1], before[1])
    assert all(tokenizer.decode([t]).isdigit() for t in torch.isfinite(logits[2]).nonzero().view(-1).tolist())
    assert Masks(frozenset([eos])).apply(logits, [None, None, None]) == 0
