"""Schemathesis against `/openapi.json` of a live deployment, on every route: schema-valid requests (positive)
and schema-violating ones (negative).

What must hold, whatever the request: no 5xx, no hang (each call has a deadline), a status and Content-Type the
document lists, a body that matches its schema (each server-sent event too), negative data refused with a 4xx,
and positive data accepted unless one of the rules JSON Schema cannot state refuses it (token limits, prompts
times `n`, prompt log-probabilities while streaming, a chat template that cannot render the messages).

CI runs a fixed, derandomized set (FUZZ_EXAMPLES per route and mode, about 300 requests). Set
CONVEYOR_FUZZ_EXAMPLES=500 (say) for a longer run with fresh random cases each time.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import Server, wait_for
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("CONVEYOR_FUZZ_EXAMPLES", "0"))
FUZZ_EXAMPLES = EXAMPLES or 25
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
CALL_TIMEOUT = 60  # seconds: a request that takes longer is a hang
NEW_TOKENS = 8  # valid requests generate at most this many tokens, so that a few hundred of them stay quick

POST_ROUTES = [
    "/",
    "/generate",
    "/generate_stream",
    "/tokenize",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/admin/groups/{index}/drain",
    "/admin/groups/{index}/resume",
    "/v1/embeddings",
    "/embed",
    "/rerank",
    "/v1/rerank",
]
# These generate nothing (a one-group server refuses to drain its only group: the fuzzing leaves it serving; the
# embedding and rerank routes answer prompt-only requests, refused here since this deployment only generates:
# tests/e2e/test_embeddings.py serves them).
NO_GENERATION_ROUTES = (
    "/v1/embeddings",
    "/embed",
    "/rerank",
    "/v1/rerank",
    "/v1/messages/count_tokens",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/admin/groups/{index}/drain",
    "/admin/groups/{index}/resume",
)
GET_ROUTES = [
    "/v1/models",
    "/health",
    "/info",
    "/metrics",
    "/v1/requests",
    "/dashboard",
    "/dashboard/state",
    "/v1/responses/{id}",
]
DELETE_ROUTES = ["/v1/requests/{id}", "/v1/responses/{id}"]
# 422s that schema-valid requests may get: the token limits, and the rules the schemas give in words only.
TOKEN_RULES = (
    "`inputs` must have less than",
    "tokens + `max_new_tokens` must be <=",
    "which leaves no room for new tokens",
    "choices (prompts times `n`) per request",
    "`decoder_input_details` == true is not supported when streaming",
    "the chat template could not render the messages",
    # a constraint that does not compile, or JSON text that is not a schema
    "invalid json schema: ",
    "invalid regex: ",
    "invalid grammar: ",
    "the JSON schema is not valid JSON",
    "a JSON schema must be a JSON object",
    # rules between fields, which the schemas state in words only (router/api/openai.py's docstrings)
    "at most one constraint per request",
    "`structured_outputs`: takes one constraint",
    "`stream_options` is only allowed when `stream` is true",
    "`top_logprobs` needs `logprobs` set to true",
    "`tool_choice` needs `tools`",
    "cannot be combined with this `tool_choice`",
    "name one limit: give one, or equal values",
    "a message of role tool needs",
    "only assistant messages carry `tool_calls`",
    "each message needs a string `content`",
    "only assistant messages carry `reasoning_content`",
    # chat_template_kwargs: names the router sets, and special tokens' text (the tokenizer's to know)
    "`chat_template_kwargs` may not",
    # tools: what a schema cannot say of a list (unique names) or of one field given another
    "a tool call's `arguments` must be JSON text",
    "`tools` has two functions of the same name",
    "which is not in `tools`",
    # the Responses API: items the model is not shown
    "`input` has nothing to answer",
    # images (a chat's image parts, the Responses API's input_image, Anthropic's image blocks) to a text model
    "this model takes no images",
    # Anthropic's Messages API: its rules between fields (router/api/anthropic.py's docstrings)
    "the last message must be the user's",
    "`tools` has two tools of the same name",
    "a user message carries text, `image` and `tool_result` blocks only",
    "an assistant message carries no `tool_result` or `image` blocks",
    # embeddings and rerank: a task this deployment was not started with (--task)
    "this deployment does not serve",
)
# Anthropic's routes answer an invalid request 400 (Conveyor's 422 elsewhere).
REFUSED = {"/v1/messages": 400, "/v1/messages/count_tokens": 400}


@pytest.fixture(scope="module")
def api(server: Server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_every_route_is_fuzzed(api, server: Server) -> None:
    operations = {(r.ok().method.upper(), r.ok().path) for r in api.get_all_operations()}
    expected = (
        {("POST", p) for p in POST_ROUTES} | {("GET", p) for p in GET_ROUTES} | {("DELETE", p) for p in DELETE_ROUTES}
    )
    assert operations - {("GET", "/openapi.json")} == expected
    # The document's own route (schemathesis leaves it out; tests/e2e/test_openapi.py validates it) is the rest of
    # what the app serves, which tests/e2e/test_openapi.py checks against the routing table.
    documented = set(httpx.get(f"{server.url}/openapi.json").json()["paths"])
    assert documented == {path for _, path in expected} | {"/openapi.json"}


def _integers(value: Any) -> Any:
    """JSON Schema's "integer" admits 490.0, which Conveyor refuses where an integer is expected (as TGI does),
    and which no client sends for a count: the fuzzer's integral floats go out as integers."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {k: _integers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integers(v) for v in value]
    return value


def _few_tokens(path: str, body: Any) -> None:
    """Caps what a valid request generates: absent or large token counts become NEW_TOKENS."""
    if not isinstance(body, dict) or path in NO_GENERATION_ROUTES:  # these generate nothing
        return
    if path == "/v1/responses":
        given = body.get("max_output_tokens")
        body["max_output_tokens"] = min(given, NEW_TOKENS) if isinstance(given, int) else NEW_TOKENS
        return
    if path.startswith("/v1/"):
        given = [body[name] for name in ("max_tokens", "max_completion_tokens") if isinstance(body.get(name), int)]
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int):
                body[name] = min(*given, NEW_TOKENS)  # both names given: one value (two are a 422)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = NEW_TOKENS
        return
    parameters = body.get("parameters")
    if parameters is None:
        parameters = body["parameters"] = {}
    if isinstance(parameters, dict):
        current = parameters.get("max_new_tokens")
        parameters["max_new_tokens"] = min(current, NEW_TOKENS) if isinstance(current, int) else NEW_TOKENS


def _fuzz(api, server: Server, method: str, path: str, mode: GenerationMode) -> None:
    operation = api[path][method]

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=not EXAMPLES,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        if case.body is not None and not isinstance(case.body, (bytes, str)):
            case.body = _integers(case.body)
            if mode is GenerationMode.POSITIVE:
                _few_tokens(path, case.body)
        response = case.call(base_url=server.url, timeout=CALL_TIMEOUT)
        case.validate_response(response, checks=CHECKS)
        if mode is GenerationMode.POSITIVE and response.status_code == REFUSED.get(path, 422):
            error = response.json()["error"]
            message = error["message"] if isinstance(error, dict) else error
            assert any(rule in message for rule in TOKEN_RULES), f"schema-valid request refused: {message}"

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path", POST_ROUTES)
def test_fuzz_post_routes(api, server: Server, path: str, mode: GenerationMode) -> None:
    _fuzz(api, server, "POST", path, mode)


@pytest.mark.parametrize("path", GET_ROUTES)
def test_fuzz_get_routes(api, server: Server, path: str) -> None:
    _fuzz(api, server, "GET", path, GenerationMode.POSITIVE)


@pytest.mark.parametrize("path", DELETE_ROUTES)
def test_fuzz_delete_routes(api, server: Server, path: str) -> None:
    """Any id: a 404 (none is in flight), never a 5xx."""
    _fuzz(api, server, "DELETE", path, GenerationMode.POSITIVE)


def test_the_server_is_healthy_after_the_fuzzing(server: Server) -> None:
    with server.client() as client:
        assert client.get("/health").status_code == 200

        def all_blocks_free() -> bool:
            info = client.get("/info").json()
            return info["kv_blocks_free"] == info["kv_blocks_total"]

        wait_for(all_blocks_free, 30, "every KV block to be free after the fuzzing")
