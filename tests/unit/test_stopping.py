"""Stopping rules: EOS, stop sequences spanning tokens, the token allowance, and their precedence; a constrained
request's grammar, which decides where its EOS ids end it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from conveyor.grammar import Constraint, GrammarCache
from conveyor.shard.batch.request_state import RequestState
from conveyor.shard.batch.stopping import FinishReason, StoppingCriteria
from conveyor.v1 import shard_pb2 as pb


def criteria(**kwargs: Any) -> StoppingCriteria:
    return StoppingCriteria(
        **{"eos_token_ids": frozenset({1, 7}), "max_new_tokens": 10, "stop_sequences": [], **kwargs}
    )


def feed(c: StoppingCriteria, pieces: list[tuple[int, str]]) -> list[FinishReason | None]:
    """Calls `c` once per (token, piece) with the text so far, as a shard does."""
    text, out = "", []
    for token, piece in pieces:
        text += piece
        out.append(c(token, text))
    return out


def test_reasons_match_the_proto_enum() -> None:
    for reason in FinishReason:
        assert pb.FinishReason.Value(f"FINISH_REASON_{reason.name}") == reason


def test_nothing_stops_an_ordinary_token() -> None:
    c = criteria()
    assert feed(c, [(5, "a"), (6, "b")]) == [None, None]
    assert c.generated_tokens == 2


def test_any_eos_id_stops() -> None:
    assert feed(criteria(), [(5, "a"), (7, "")]) == [None, FinishReason.EOS_TOKEN]
    assert feed(criteria(), [(1, "")]) == [FinishReason.EOS_TOKEN]


def test_ignore_eos_keeps_going_until_the_allowance() -> None:
    c = criteria(max_new_tokens=3, ignore_eos=True)
    assert feed(c, [(1, ""), (7, ""), (1, "")]) == [None, None, FinishReason.LENGTH]


def test_max_new_tokens_stops_with_length() -> None:
    c = criteria(max_new_tokens=2)
    assert feed(c, [(5, "a"), (6, "b")]) == [None, FinishReason.LENGTH]
    assert c.generated_tokens == 2


def test_stop_sequence_spanning_tokens_is_found_when_it_completes() -> None:
    c = criteria(stop_sequences=["END"])
    assert feed(c, [(5, "foo E"), (6, "N"), (8, "D more")]) == [None, None, FinishReason.STOP_SEQUENCE]


def test_stop_sequence_inside_one_token() -> None:
    assert feed(criteria(stop_sequences=["\n\n"]), [(5, "a"), (6, "b\n\nc")]) == [None, FinishReason.STOP_SEQUENCE]


def test_any_of_several_stop_sequences_stops() -> None:
    c = criteria(stop_sequences=["never", "</end>"])
    assert feed(c, [(5, "x </"), (6, "end"), (8, ">")]) == [None, None, FinishReason.STOP_SEQUENCE]


def test_only_a_completed_stop_sequence_stops() -> None:
    c = criteria(stop_sequences=["ab"])
    assert feed(c, [(5, "x"), (6, "a"), (8, "c"), (9, "a")]) == [None, None, None, None]
    assert c(10, "xacab") == FinishReason.STOP_SEQUENCE


def test_a_token_that_adds_no_text_finds_nothing_new() -> None:
    # The detokenizer holds back a character's first bytes: the text does not grow on that step.
    c = criteria(stop_sequences=["世"])
    assert feed(c, [(5, "a"), (6, ""), (8, "世")]) == [None, None, FinishReason.STOP_SEQUENCE]


def test_an_empty_stop_sequence_never_stops() -> None:
    assert feed(criteria(stop_sequences=[""]), [(5, "a"), (6, "b")]) == [None, None]


def test_eos_takes_precedence_over_stop_sequences_and_length() -> None:
    assert feed(criteria(max_new_tokens=1), [(1, "")]) == [FinishReason.EOS_TOKEN]
    assert feed(criteria(max_new_tokens=1, stop_sequences=["x"]), [(1, "x")]) == [FinishReason.EOS_TOKEN]


def test_stop_sequence_takes_precedence_over_length() -> None:
    assert feed(criteria(max_new_tokens=1, stop_sequences=["x"]), [(5, "x")]) == [FinishReason.STOP_SEQUENCE]


# --- a constrained request: its grammar says where its text ends ---------------------------------------------------


class Constrained:
    """RequestStates of the tiny model under a grammar, stepped through chosen tokens as a shard steps them. The
    model declares an ordinary token (" >=") as its second EOS id (tests/conftest.py), as a real model may."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos_ids = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
        self.eos_ids, self.text_eos = frozenset(eos_ids), eos_ids[1]  # [</s>, the ordinary one]
        self.vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_ids)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def steps(self, constraint: Constraint, tokens: list[int]) -> list[pb.Generation]:
        """Each token's Generation, stepping a fresh request under `constraint` (max_new_tokens 50)."""
        request = pb.Request(
            id=1,
            input_ids=self.tokens("Weather?"),
            stopping_parameters=pb.StoppingParameters(max_new_tokens=50),
            blocks=[0],
            grammar=constraint.grammar,
        )
        state = RequestState.from_pb(request, self.tokenizer, self.eos_ids, self.vocab_size, self.grammars)
        special = frozenset(self.tokenizer.all_special_ids)
        return [state.step(token, 0.0, self.tokenizer, special) for token in tokens]


@pytest.fixture(scope="module")
def constrained(tiny_model: Path) -> Constrained:
    return Constrained(tiny_model)


def test_an_eos_id_the_grammar_reads_as_text_does_not_end_a_constrained_request(constrained: Constrained) -> None:
    """Issue 60: a forced call ended `completed` with arguments `{"city": ") >=`. llguidance reads the ordinary
    EOS id as text inside a JSON string (it fits there), and the request ended on it mid-string as if at EOS. Now
    the grammar decides: the string goes on, and the request ends when the JSON is whole."""
    c = constrained
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tokens = [*c.tokens('{"city": ")'), c.text_eos, *c.tokens('"}')]
    generations = c.steps(Constraint.json_schema(schema), tokens)
    assert [g.HasField("finished") for g in generations] == [False] * (len(tokens) - 1) + [True]
    finished = generations[-1].finished
    assert finished.finish_reason == pb.FINISH_REASON_EOS_TOKEN  # the grammar ended it
    assert json.loads(finished.text) == {"city": ")" + c.tokenizer.decode([c.text_eos])}


def test_an_eos_id_ends_a_constrained_request_where_its_grammar_may_end(constrained: Constrained) -> None:
    c = constrained
    for eos in sorted(c.eos_ids):
        generations = c.steps(Constraint.regex("[a-z]+"), [*c.tokens("ab"), eos])
        assert [g.HasField("finished") for g in generations] == [False] * (len(generations) - 1) + [True]
        assert generations[-1].finished.finish_reason == pb.FINISH_REASON_EOS_TOKEN
