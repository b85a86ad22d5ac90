"""Speculative decoding through the real processes: what drafts must not change, and what they report.

One deployment drafts at every decode step of any batch (`--speculate-max-batch 64`, and `--speculate-policy fixed`:
every request has all its drafts at each step, whatever it accepted, so that these tests reach the cases they
name; the default policy's choice is unit-tested, and the oracle runs with it); each test compares a
request served with drafts against the same request with `speculate: 0` on the same server, and checks that
drafts were verified, so that none can pass with speculation silently off. The greedy oracle with drafts, on 1
and 2 shards with joins and a cancellation, is in tests/e2e/test_oracle.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import Server, greedy_reference, start_server

from conveyor.client import Client

REPEATING = "one two three four five six seven eight. " * 3 + "one two three"
SEEDS = range(48)


@pytest.fixture(scope="module")
def drafting(tiny_model: Path) -> Iterator[Server]:
    server = start_server(
        tiny_model,
        *(
            "--speculate",
            "4",
            "--speculate-max-batch",
            "64",
            "--speculate-policy",
            "fixed",
            "--max-total-tokens",
            "512",
        ),
    )
    yield server
    assert server.stop() == 0


def _generate(server: Server, parameters: dict, prompt: str = REPEATING) -> dict:
    body = {"inputs": prompt, "parameters": {"details": True, **parameters}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _ids(answer: dict) -> list[int]:
    return [t["id"] for t in answer["details"]["tokens"]]


def test_a_seed_gives_the_same_tokens_with_drafts_as_without(drafting: Server) -> None:
    """Each position is sampled with the request's own next draw, drafts or not: the same seed gives the same
    tokens, so the sampled distribution is the target's, seed by seed, and a rerun gives them again."""
    sampling = {"do_sample": True, "temperature": 0.1, "max_new_tokens": 24}

    def both(seed: int) -> tuple[dict, dict]:
        return _generate(drafting, {**sampling, "seed": seed}), _generate(
            drafting, {**sampling, "seed": seed, "speculate": 0}
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(both, SEEDS))
    for seed, (drafted, plain) in zip(SEEDS, answers):
        assert _ids(drafted) == _ids(plain), f"seed {seed}"
        assert "drafted_tokens" not in plain["details"]
    assert sum(a["details"].get("drafted_tokens", 0) for a, _ in answers) > 0
    assert len({tuple(_ids(a)) for a, _ in answers}) > 1  # the seeds do draw different texts
    again = _generate(drafting, {**sampling, "seed": SEEDS[0]})
    assert _ids(again) == _ids(answers[0][0])


def test_greedy_details_report_drafts_and_metrics_count_them(drafting: Server, tiny_model: Path) -> None:
    accepted = drafting.metric("conveyor_speculative_accepted_tokens_total")
    answer = _generate(drafting, {"max_new_tokens": 40})
    assert _ids(answer) == greedy_reference(tiny_model, REPEATING, 40)
    details = answer["details"]
    assert details["drafted_tokens"] > 0 and 0 < details["accepted_tokens"] <= details["drafted_tokens"]
    assert details["acceptance_rate"] == round(details["accepted_tokens"] / details["drafted_tokens"], 4)
    assert drafting.metric("conveyor_speculative_accepted_tokens_total") - accepted == details["accepted_tokens"]
    dashboard = httpx.get(f"{drafting.url}/dashboard/state", timeout=30).json()["speculative"]
    assert dashboard["accepted"] >= details["accepted_tokens"] and dashboard["drafted"] >= details["drafted_tokens"]


def test_max_new_tokens_and_stop_sequences_cut_drafts_at_the_right_token(drafting: Server, tiny_model: Path) -> None:
    reference = greedy_reference(tiny_model, REPEATING, 40)
    for n in (2, 7, 13):
        answer = _generate(drafting, {"max_new_tokens": n})
        assert _ids(answer) == reference[:n] and answer["details"]["finish_reason"] == "length"
    # The tiny model's greedy text here says " Return node" over and over from token 10, and drafts are accepted
    # from token 13 on: a stop that ends with token 14 cuts the step that made tokens 13-15 after its first draft.
    plain = _generate(drafting, {"max_new_tokens": 40, "speculate": 0})
    stop = "".join(t["text"] for t in plain["details"]["tokens"][9:14])
    with_stop = {"max_new_tokens": 40, "stop": [stop]}
    drafted, undrafted = _generate(drafting, with_stop), _generate(drafting, {**with_stop, "speculate": 0})
    assert _ids(drafted) == _ids(undrafted) == reference[:14]
    assert drafted["generated_text"] == undrafted["generated_text"] and drafted["generated_text"].endswith(stop)
    assert drafted["details"]["finish_reason"] == "stop_sequence" and drafted["details"]["accepted_tokens"] > 0


def test_a_grammar_request_is_not_drafted_for_and_keeps_its_output(drafting: Server) -> None:
    grammar = {"type": "regex", "value": "(one |two |three ){6}"}
    parameters = {"max_new_tokens": 30, "grammar": grammar}
    drafted, plain = _generate(drafting, parameters), _generate(drafting, {**parameters, "speculate": 0})
    assert drafted["generated_text"] == plain["generated_text"]
    assert "drafted_tokens" not in drafted["details"]


def test_openai_n_choices_and_grpc_speculate_alike(drafting: Server) -> None:
    body = {"model": "x", "prompt": REPEATING, "max_tokens": 20, "temperature": 0.1, "seed": 7, "n": 3}
    drafted = httpx.post(f"{drafting.url}/v1/completions", json=body, timeout=300).json()
    plain = httpx.post(f"{drafting.url}/v1/completions", json={**body, "speculate": 0}, timeout=300).json()
    assert [c["text"] for c in drafted["choices"]] == [c["text"] for c in plain["choices"]]
    with Client(drafting.grpc, timeout=300) as client:
        answers = [client.generate(REPEATING, max_new_tokens=20, speculate=s, details=True) for s in (None, 0)]
    assert answers[0].generated_text == answers[1].generated_text
    assert answers[0].details.drafted_tokens > 0 and answers[1].details.drafted_tokens == 0


def test_speculate_beyond_the_limit_is_a_422(drafting: Server) -> None:
    response = httpx.post(f"{drafting.url}/generate", json={"inputs": "x", "parameters": {"speculate": 17}}, timeout=30)
    assert response.status_code == 422 and "speculate" in response.json()["error"]
