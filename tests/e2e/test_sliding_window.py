"""A sliding-window model (Mistral-style, a 16-token window) under the scheduler's harder paths: prefix-cache hits
and preemption must stay exactly what transformers' `generate()` yields with the same window."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import Server, free_port, greedy_reference, start_server, wait_for
from test_scheduling import (
    BLOCK,
    COMMON_PREFIX,
    PREEMPT_NEW_TOKENS,
    PREEMPT_REQUESTS,
    PREFIX_NEW_TOKENS,
    TAILS,
    all_blocks_free,
    assert_exact,
    cache_counts,
    counter,
    generated_ids,
    run_streams,
    token_ids,
)

from conveyor.demo_model import MISTRAL_WINDOW


@pytest.fixture(scope="module")
def windowed(mistral_model: Path) -> Iterator[Server]:
    """Prefix caching on (the default) and a pool of 512 tokens, which the preemption test outgrows."""
    server = start_server(
        mistral_model, "--master-port", str(free_port()), "--max-batch-total-tokens", "512", "--max-total-tokens", "256"
    )
    yield server
    assert server.stop() == 0


def test_prefix_hits_stay_exact(windowed: Server, mistral_model: Path) -> None:
    prompts = [COMMON_PREFIX + tail for tail in TAILS]
    assert len(token_ids(mistral_model, prompts[0])) > 2 * BLOCK > MISTRAL_WINDOW
    first = generated_ids(windowed, prompts[0], PREFIX_NEW_TOKENS)
    assert_exact(mistral_model, prompts[0], first, PREFIX_NEW_TOKENS)
    wait_for(lambda: all_blocks_free(windowed), 60, "every block to be free again")
    hits_before, _ = cache_counts(windowed)
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: generated_ids(windowed, p, PREFIX_NEW_TOKENS), prompts))
    for prompt, ids in zip(prompts, results):
        assert_exact(mistral_model, prompt, ids, PREFIX_NEW_TOKENS)
    assert cache_counts(windowed)[0] > hits_before, "the shared prefix's blocks were reused"
    wait_for(lambda: all_blocks_free(windowed), 60, "every block to be free again")


def test_preemption_resumes_exactly(windowed: Server, mistral_model: Path) -> None:
    prompts = [f"def step_{n}(x):" for n in range(PREEMPT_REQUESTS)]
    for prompt in prompts:  # random weights never pick EOS: every request runs its full length
        assert len(greedy_reference(mistral_model, prompt, PREEMPT_NEW_TOKENS)) == PREEMPT_NEW_TOKENS
    preemptions_before = counter(windowed, "conveyor_preemptions_total")
    watchers = run_streams(windowed, prompts)
    for prompt, w in zip(prompts, watchers):
        assert all("error" not in e for e in w.events), w.events[-1]
        assert_exact(mistral_model, prompt, [e["token"]["id"] for e in w.events], PREEMPT_NEW_TOKENS)
    assert counter(windowed, "conveyor_preemptions_total") > preemptions_before
    wait_for(lambda: all_blocks_free(windowed), 60, "every block to be free again")
