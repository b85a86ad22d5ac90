"""`/metrics` parses as Prometheus text and its numbers move as requests are served."""

from __future__ import annotations

import httpx
from conftest import Server
from prometheus_client.parser import text_string_to_metric_families


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_and_histograms_move_with_requests(server: Server) -> None:
    before = scrape(server)
    r = httpx.post(
        f"{server.url}/generate",
        json={"inputs": "def f():", "parameters": {"max_new_tokens": 5, "speculate": 0}},  # a decode step per token
        timeout=60,
    )
    assert r.status_code == 200
    assert httpx.post(f"{server.url}/generate", json={"inputs": ""}).status_code == 422
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("conveyor_requests_total", outcome="success") == 1
    assert delta("conveyor_requests_total", outcome="validation") == 1
    assert delta("conveyor_generated_tokens_total") == 5
    assert delta("conveyor_prompt_tokens_total") == len(
        httpx.post(f"{server.url}/tokenize", json={"inputs": "def f():"}).json()
    )
    assert delta("conveyor_time_to_first_token_seconds_count") == 1
    assert delta("conveyor_inter_token_latency_seconds_count") == 4
    assert delta("conveyor_request_duration_seconds_count") == 1
    assert delta("conveyor_request_queue_duration_seconds_count") == 1
    assert delta("conveyor_batch_step_duration_seconds_count", method="prefill") >= 1
    assert delta("conveyor_batch_step_duration_seconds_count", method="decode") >= 4
    assert value(after, "conveyor_kv_blocks_total") > 0
    assert value(after, "conveyor_kv_blocks_used") == 0  # every block is back once nothing runs
    assert value(after, "conveyor_queue_size") == 0 and value(after, "conveyor_batch_current_size") == 0


def test_the_draft_choice_shows_its_measured_step_costs_and_offers(server: Server) -> None:
    """Drafts are on by default and chosen by what they earn: the warmup's step costs are in /metrics (one row is
    the unit; a verify step of several rows never costs less), and a request that repeats its prompt is offered
    drafts, which are verified and mostly accepted."""
    before = scrape(server)
    ratios = {
        int(labels[1][1]): v for (name, labels), v in before.items() if name == "conveyor_speculative_step_cost_ratio"
    }
    assert ratios[1] == 1.0 and set(range(1, 10)) <= set(ratios)  # --speculate 8: rows 1 to 9, and more
    # Timed, so only their order is certain: a step of more rows never shows as cheaper (on the tiny model a
    # 1-row step's own noise can equal a larger one's cost).
    ordered = [ratios[rows] for rows in sorted(ratios)]
    assert ordered == sorted(ordered) and all(r >= 1.0 for r in ordered), ratios
    prompt = "alpha beta gamma delta epsilon zeta eta theta. " * 6
    r = httpx.post(f"{server.url}/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 40}}, timeout=60)
    assert r.status_code == 200, r.text
    after = scrape(server)
    offered = value(after, "conveyor_speculative_offered_tokens_total") - value(
        before, "conveyor_speculative_offered_tokens_total"
    )
    drafted = value(after, "conveyor_speculative_drafted_tokens_total") - value(
        before, "conveyor_speculative_drafted_tokens_total"
    )
    assert offered >= drafted > 0
    assert 0.0 < value(after, "conveyor_speculative_acceptance", group="0") <= 1.0
