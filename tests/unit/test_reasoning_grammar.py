"""A constraint after a reasoning block (conveyor/grammar.py `Constraint.after_reasoning`, and when the chat route
asks for it: router/pipeline/reasoning.py `Reasoning.constrain`), compiled by llguidance on the tiny model's
tokenizer: free text without the closing tag in the block, the constraint after it; the block optional where the
model may open one, required where the prompt opened it; each kind of constraint."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conveyor.grammar import Constraint, GrammarCache
from conveyor.router.pipeline.reasoning import Reasoning

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, None, frozenset([tokenizer.eos_token_id]))


def _accepts(grammars: GrammarCache, tokenizer, constraint: Constraint, text: str) -> bool:
    """Whether the constraint lets the model write `text` and stop there."""
    matcher = grammars.matcher(constraint.grammar)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


FREE = [
    ('<think>\nI will say 4. {"n": no} </thin </think>\n\n{"n": 4}', True),
    ('{"n": 4}', True),  # no block: the model may answer at once
    ('<think>a</think>{"n": 4}', True),
    ("<think>a</think>four", False),  # the answer is still constrained
    ('<think>a</think>{"n": 4}</think>', False),  # the block ends at its first closing tag
    ('{"n": 4}<think>a</think>', False),
]
INSIDE = [
    ('thinking, with <think> even\n</think>\n\n{"n": 4}', True),
    ('</think>{"n": 4}', True),
    ('{"n": 4}', False),  # the block the prompt opened must close first
]


@pytest.mark.parametrize(("text", "accepted"), FREE)
def test_a_block_the_model_may_open_comes_before_the_answer(grammars, tokenizer, text: str, accepted: bool) -> None:
    constraint = Constraint.json_schema(SCHEMA).after_reasoning("<think>", "</think>")
    assert _accepts(grammars, tokenizer, constraint, text) is accepted


@pytest.mark.parametrize(("text", "accepted"), INSIDE)
def test_a_block_the_prompt_opened_must_close_first(grammars, tokenizer, text: str, accepted: bool) -> None:
    constraint = Constraint.json_schema(SCHEMA).after_reasoning("", "</think>")
    assert _accepts(grammars, tokenizer, constraint, text) is accepted


@pytest.mark.parametrize(
    ("constraint", "answer"),
    [
        (Constraint.regex("[0-9]{2}"), "42"),
        (Constraint.choice(["yes", "no"]), "no"),
        (Constraint.grammar_text('start: "x" ("y" | "z")'), "xz"),
        (Constraint("json_object"), '{"a": 1}'),
    ],
    ids=["regex", "choice", "grammar", "json_object"],
)
def test_every_kind_can_follow_a_block(grammars, tokenizer, constraint: Constraint, answer: str) -> None:
    wrapped = constraint.after_reasoning("<think>", "</think>")
    assert _accepts(grammars, tokenizer, wrapped, f"<think>hm</think>\n{answer}")
    assert _accepts(grammars, tokenizer, wrapped, answer)
    assert not _accepts(grammars, tokenizer, wrapped, "<think>hm</think>\nnot it")
    assert wrapped != constraint and wrapped.kind == constraint.kind and constraint.grammar != wrapped.grammar


def test_the_chat_route_wraps_what_applies_to_the_answer() -> None:
    schema = Constraint.json_schema(SCHEMA)
    assert Reasoning("free").constrain(schema) == schema.after_reasoning("<think>", "</think>")
    assert Reasoning("inside").constrain(schema) == schema.after_reasoning("", "</think>")
    assert Reasoning("closed").constrain(schema) == schema  # the prompt closed the block: all answer
    assert Reasoning("free").constrain(None) is None
    shaped = Constraint.regex("<think>[a-z]+</think>[a-z]+")  # writes the block itself: applies as it is
    assert Reasoning("free").constrain(shaped) == shaped
