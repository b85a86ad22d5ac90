"""Hostile bodies through a live deployment: each gets a 4xx JSON error, and the server serves on."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
from conftest import Server
from conveyor.router.validation import MAX_JSON_DEPTH, Limits, Validation, ValidationError, parse_json

DEEP_ARRAY = b"[" * 100_000 + b"]" * 100_000
DEEP_PARAMETERS = b'{"inputs": "x", "parameters": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}"
ROUTES = ["/generate", "/generate_stream", "/", "/tokenize", "/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("body", [DEEP_ARRAY, DEEP_PARAMETERS], ids=["array-100k-deep", "parameters-5k-deep"])
@pytest.mark.parametrize("route", ROUTES)
def test_deeply_nested_json_is_a_clean_422(server: Server, route: str, body: bytes) -> None:
    with server.client() as client:
        response = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    payload = response.json()
    assert payload["error_type"] == "validation"


def test_the_server_serves_after_hostile_bodies(server: Server) -> None:
    with server.client() as client:
        client.post("/generate", content=DEEP_ARRAY, headers={"Content-Type": "application/json"})
        body = {"inputs": "def f():", "parameters": {"max_new_tokens": 3, "details": True}}
        response = client.post("/generate", json=body)
    assert response.status_code == 200 and response.json()["details"]["generated_tokens"] >= 1


def test_json_depth_limit() -> None:
    parse_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)  # at the limit: fine
    with pytest.raises(ValidationError, match="nested"):
        parse_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(ValidationError, match="not valid JSON"):
        parse_json(b"\xff\xfe{")


async def test_validation_runs_on_a_worker_with_the_callers_context(tiny_model) -> None:
    """Tokenizing a multi-megabyte prompt takes over a second: it must not run on the event loop."""
    from transformers import AutoTokenizer

    validation = Validation(AutoTokenizer.from_pretrained(tiny_model), Limits(max_input_tokens=32, max_total_tokens=64))
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker")
    marker.set("caller")

    def where() -> tuple[str, str]:
        return threading.current_thread().name, marker.get()

    name, seen = await validation.off_loop(where)
    assert name.startswith("validation") and name != threading.current_thread().name
    assert seen == "caller"
    valid = await validation.off_loop(validation.validate_json, b'{"inputs": "def f():"}', stream=False)
    assert valid.input_ids
    assert asyncio.get_running_loop().is_running()
