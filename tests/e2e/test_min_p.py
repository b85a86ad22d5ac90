"""`min_p` end to end: the sampling parameter added by declaring it once (router/api/tgi.py's `SharedSampling`),
once in each proto, and once in the sampler. Every front door takes it, validates it, and the shards apply it.

min_p = 1 keeps only the most likely token, so a hot, seeded sampling request with it yields exactly what
transformers' greedy `generate()` yields; the same request without it does not (which shows the parameter is
what made the difference, not the seed).
"""

from __future__ import annotations

import httpx
import pytest
from conftest import Server, greedy_reference

from conveyor.client import Client, ValidationError

PROMPT = "def add(a, b):"
TOKENS = 8
HOT = {"do_sample": True, "temperature": 50.0, "seed": 3}


def _tgi_ids(server: Server, **parameters: object) -> list[int]:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "details": True, **parameters}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_tgi_route(server: Server) -> None:
    greedy = greedy_reference(server.model_dir, PROMPT, TOKENS)
    assert _tgi_ids(server, **HOT, min_p=1.0) == greedy
    assert _tgi_ids(server, **HOT) != greedy


def test_openai_routes(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 2.0, "seed": 3, "logprobs": 1}

    def ids(**extra: object) -> list[str]:
        response = httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"]["tokens"]

    greedy_text = ids(temperature=0)
    assert ids(min_p=1.0) == greedy_text
    assert ids() != greedy_text
    # Greedy (temperature 0) drops min_p, as it drops every warper.
    assert ids(temperature=0, min_p=0.5) == greedy_text


def test_grpc_front_door(server: Server) -> None:
    greedy = greedy_reference(server.model_dir, PROMPT, TOKENS)
    with Client(server.grpc, timeout=60) as client:
        response = client.generate(PROMPT, max_new_tokens=TOKENS, **HOT, min_p=1.0)
        assert [t.id for t in response.details.tokens] == greedy
        with pytest.raises(ValidationError, match="min_p"):
            client.generate(PROMPT, max_new_tokens=TOKENS, min_p=1.5)


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.5", True])
def test_out_of_range_is_a_422_on_every_route(server: Server, value: object) -> None:
    bodies = {
        "/generate": {"inputs": PROMPT, "parameters": {"min_p": value}},
        "/v1/completions": {"prompt": PROMPT, "min_p": value},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "min_p": value},
    }
    for path, body in bodies.items():
        response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert response.status_code == 422, (path, response.text)
        error = response.json()["error"]
        assert "min_p" in (error["message"] if isinstance(error, dict) else error)


def test_the_document_declares_it(server: Server) -> None:
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    for name in ("GenerateParameters", "CompletionRequest", "ChatRequest"):
        min_p = schemas[name]["properties"]["min_p"]
        assert min_p["minimum"] == 0 and min_p["maximum"] == 1, (name, min_p)
