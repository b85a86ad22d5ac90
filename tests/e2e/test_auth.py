"""The API key on generation routes, open probes, and JSON errors for bodies over the size limit."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from conftest import Server, start_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def locked(tiny_model: Path):
    server = start_server(tiny_model, "--api-key", KEY, "--payload-limit", "10000")
    yield server
    assert server.stop() == 0


BODY = {"inputs": "x", "parameters": {"max_new_tokens": 2}}


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/", "/tokenize", "/v1/completions"])
def test_generation_routes_need_the_key(locked: Server, route: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{locked.url}{route}", json=BODY, headers=headers)
        assert r.status_code == 401 and r.json()["error_type"] == "unauthorized"


def test_the_right_key_is_served(locked: Server) -> None:
    r = httpx.post(f"{locked.url}/generate", json=BODY, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200
    client = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="m", prompt="x", max_tokens=2, temperature=0).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked.url}/v1", api_key="nope", max_retries=0).completions.create(
            model="m", prompt="x", max_tokens=2
        )


@pytest.mark.parametrize("route", ["/health", "/info", "/v1/models"])
def test_probes_stay_open(locked: Server, route: str) -> None:
    assert httpx.get(f"{locked.url}{route}").status_code == 200


def test_an_oversized_body_is_413_json(locked: Server) -> None:
    big = {"inputs": "x" * 20_000}
    r = httpx.post(f"{locked.url}/generate", json=big, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_unknown_routes_are_json_404(locked: Server) -> None:
    r = httpx.get(f"{locked.url}/no/such/route")
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"


def test_grpc_front_door_needs_the_key_too(locked: Server) -> None:
    from conveyor.client import Client, UnauthorizedError

    with Client(locked.grpc, timeout=60) as anonymous, pytest.raises(UnauthorizedError):
        anonymous.generate("x", max_new_tokens=2)
    with Client(locked.grpc, api_key=KEY, timeout=60) as client:
        assert client.generate("x", max_new_tokens=2).details.generated_tokens == 2
