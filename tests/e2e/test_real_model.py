"""The real model (SmolLM2-135M-Instruct, benchmarks/real_model.py) through the real launcher, router and shard.

Random weights hide what a real checkpoint shows: whether its conversion kept the model (it answers a plain
question sensibly), and whether the oracle holds on real weights, a real tokenizer and real text. The model is
prepared once (a ~93 MB download the first time, then the cache) and served by one deployment for the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import Server, free_port, greedy_reference, start_server

from benchmarks import compare, real_model
from conveyor.shard.batch.detokenize import IncrementalDetokenizer

# A prompt whose greedy continuation is 16 plain English tokens: no EOS within them, no character split across
# tokens, so every token has a text piece of its own to compare.
PROMPT = "Once upon a time,"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def real_server() -> Iterator[Server]:
    # One prompt's worth of prefill budget: the warmup prefills as many longest prompts as the budget admits, eight
    # of 511 tokens at the default, ~8 s of this module's start on 2 cores for prompts of a few tokens.
    flags = ("--max-total-tokens", "512", "--max-batch-prefill-tokens", "512", "--master-port", str(free_port()))
    server = start_server(real_model.prepare(), *flags)
    yield server
    assert server.stop() == 0


def test_the_real_model_answers_the_chat_question(real_server: Server) -> None:
    """Through the chat template, greedy: a conversion that broke the weights or the tokenizer cannot say Paris.
    The benchmark's own check (compare.check_answer) asks the same and passes too."""
    body = {
        "model": str(real_server.model_dir),
        "messages": [{"role": "user", "content": real_model.CHECK_QUESTION}],
        "max_tokens": compare.CHECK_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"{real_server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    assert real_model.CHECK_ANSWER in answer, answer
    compare.check_answer(real_server.url, str(real_server.model_dir))


def test_a_greedy_completion_is_generate_token_for_token(real_server: Server) -> None:
    """The oracle on the real model: /v1/completions greedy in float32 yields what transformers' generate() yields.
    OpenAI's completion carries text, not ids, so each token's piece (logprobs.tokens) is compared with the piece
    the shard's detokenizer makes of the reference id at that step."""
    from transformers import AutoTokenizer

    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{real_server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    completion = response.json()
    expected = greedy_reference(real_server.model_dir, PROMPT, NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(real_server.model_dir)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer(PROMPT).input_ids)
    pieces = [detokenizer.step(token) for token in expected]
    choice = completion["choices"][0]
    assert len(expected) == NEW_TOKENS and all(pieces), pieces
    assert choice["logprobs"]["tokens"] == pieces
    assert choice["text"] == tokenizer.decode(expected) and choice["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == NEW_TOKENS
