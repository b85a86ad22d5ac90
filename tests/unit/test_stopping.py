"""Stopping rules: EOS, stop sequences spanning tokens, the token allowance, and their precedence."""

from __future__ import annotations

from typing import Any

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
