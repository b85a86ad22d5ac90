"""Hostile bodies through a live deployment: each gets a 4xx JSON error, and the server serves on."""

from __future__ import annotations

import asyncio
import contextvars
import gzip
import json
import socket
import threading

import grpc
import pytest
from conftest import Server

from conveyor.router.limits import Limits
from conveyor.router.pipeline.request import tgi_request
from conveyor.router.pipeline.validation import Validation, ValidationError

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


def test_json_depth_limit(tiny_model) -> None:
    """Bodies are parsed by pydantic's JSON parser, which refuses nesting deeper than its recursion limit (about
    175 levels), below Python's own: nothing after it can recurse out of the stack."""

    from transformers import AutoTokenizer

    validation = Validation(AutoTokenizer.from_pretrained(tiny_model), Limits(max_input_tokens=32, max_total_tokens=64))

    def schema(depth: int) -> bytes:
        nested = b'{"a":' * depth + b"1" + b"}" * depth
        return b'{"inputs": "x", "parameters": {"grammar": {"type": "json", "value": ' + nested + b"}}}"

    try:
        validation.validate(
            tgi_request(schema(150), stream=False)
        )  # parsed; a schema this deep may compile or be a 422
    except ValidationError:
        pass
    with pytest.raises(ValidationError, match="not valid JSON: recursion limit"):
        validation.validate(tgi_request(schema(10_000), stream=False))
    with pytest.raises(ValidationError, match="not valid JSON"):
        validation.validate(tgi_request(b"\xff\xfe{", stream=False))


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
    valid = await validation.off_loop(validation.validate, tgi_request(b'{"inputs": "def f():"}', stream=False))
    assert valid.input_ids
    assert asyncio.get_running_loop().is_running()


# --- A fixed corpus of hostile requests (issue 11, item 5), kept as a regression test ------------------------
# Each entry: the route, the raw body, extra headers, and the status it must get. Every answer is JSON with
# `error` and `error_type` (on the OpenAI routes `error` is OpenAI's error object), never a 5xx, never a hang.

JSON = {"Content-Type": "application/json"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def _body(value: object) -> bytes:
    return json.dumps(value).encode()


def _tool(name: str, parameters: object = None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _call(arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}


def _assistant(calls: object) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _schema(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


FORCED = {"messages": HI, "tools": [_tool("f")], "tool_choice": "required"}


CORPUS: list[tuple[str, str, bytes, dict[str, str], int]] = [
    # (id, route, body, headers, status)
    # malformed and oversized JSON
    ("not-json", "/generate", b"{", JSON, 422),
    ("empty-body", "/generate", b"", JSON, 422),
    ("invalid-utf8", "/generate", b'{"inputs": "\xff\xfe"}', JSON, 422),
    ("lone-surrogate", "/generate", b'{"inputs": "\\ud800"}', JSON, 422),
    ("nan-literal", "/generate", b'{"inputs": "x", "parameters": {"temperature": NaN}}', JSON, 422),
    ("infinity-literal", "/generate", b'{"inputs": "x", "parameters": {"top_p": Infinity}}', JSON, 422),
    ("nan-in-an-ignored-field", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": NaN}', JSON, 422),
    ("5000-digit-integer", "/generate", b'{"inputs": "x", "parameters": {"seed": ' + b"9" * 5000 + b"}}", JSON, 422),
    ("5000-digit-integer-openai", COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", JSON, 422),
    ("1e400", "/generate", b'{"inputs": "x", "parameters": {"temperature": 1e400}}', JSON, 422),
    ("too-large", "/generate", b'{"inputs": "' + b"a" * 2_100_000 + b'"}', JSON, 413),
    # wrongly typed
    ("inputs-list", "/generate", _body({"inputs": ["x"]}), JSON, 422),
    ("parameters-list", "/generate", _body({"inputs": "x", "parameters": []}), JSON, 422),
    ("max-new-tokens-float", "/generate", _body({"inputs": "x", "parameters": {"max_new_tokens": 2.0}}), JSON, 422),
    ("stream-string", "/", _body({"inputs": "x", "stream": "yes"}), JSON, 422),
    ("prompt-token-ids", COMPLETIONS, _body({"prompt": [1, 2, 3]}), JSON, 422),
    ("model-not-a-string", CHAT, _body({"messages": HI, "model": 5}), JSON, 422),
    ("content-parts", CHAT, _body({"messages": [{"role": "user", "content": [{"type": "text"}]}]}), JSON, 422),
    (
        "stream-options-type",
        CHAT,
        _body({"messages": HI, "stream": True, "stream_options": {"include_usage": 1}}),
        JSON,
        422,
    ),
    ("tokenize-empty", "/tokenize", _body({"inputs": ""}), JSON, 422),
    # out of range
    ("temperature-1e308", "/generate", _body({"inputs": "x", "parameters": {"temperature": 1e308}}), JSON, 422),
    (
        "repetition-penalty-1e308",
        "/generate",
        _body({"inputs": "x", "parameters": {"repetition_penalty": 1e308}}),
        JSON,
        422,
    ),
    ("openai-temperature-3", CHAT, _body({"messages": HI, "temperature": 3}), JSON, 422),
    ("openai-temperature-1e308", COMPLETIONS, _body({"prompt": "x", "temperature": 1e308}), JSON, 422),
    ("openai-temperature-negative", COMPLETIONS, _body({"prompt": "x", "temperature": -0.5}), JSON, 422),
    ("max-tokens-0", CHAT, _body({"messages": HI, "max_tokens": 0}), JSON, 422),
    ("max-tokens-0-completions", COMPLETIONS, _body({"prompt": "x", "max_tokens": 0}), JSON, 422),
    (
        "max-completion-tokens-0-beside-max-tokens",
        CHAT,
        _body({"messages": HI, "max_tokens": 2, "max_completion_tokens": 0}),
        JSON,
        422,
    ),
    ("max-new-tokens-2^64", "/generate", _body({"inputs": "x", "parameters": {"max_new_tokens": 2**64}}), JSON, 422),
    ("seed-negative", CHAT, _body({"messages": HI, "seed": -1}), JSON, 422),
    ("n-1000", CHAT, _body({"messages": HI, "n": 1000}), JSON, 422),
    ("n-0", COMPLETIONS, _body({"prompt": "x", "n": 0}), JSON, 422),
    ("best-of-3-tgi", "/generate", _body({"inputs": "x", "parameters": {"best_of": 3}}), JSON, 422),
    ("best-of-3-openai", COMPLETIONS, _body({"prompt": "x", "best_of": 3}), JSON, 422),
    ("stop-100", "/generate", _body({"inputs": "x", "parameters": {"stop": ["a"] * 100}}), JSON, 422),
    ("stop-100-openai", CHAT, _body({"messages": HI, "stop": ["a"] * 100}), JSON, 422),
    ("top-n-tokens-1000", "/generate", _body({"inputs": "x", "parameters": {"top_n_tokens": 1000}}), JSON, 422),
    ("logprobs-1000", COMPLETIONS, _body({"prompt": "x", "logprobs": 1000}), JSON, 422),
    ("top-logprobs-1000", CHAT, _body({"messages": HI, "logprobs": True, "top_logprobs": 1000}), JSON, 422),
    ("top-logprobs-without-logprobs", CHAT, _body({"messages": HI, "top_logprobs": 2}), JSON, 422),
    ("messages-5000", CHAT, _body({"messages": HI * 5000}), JSON, 422),
    (
        "max-new-tokens-past-the-total",
        "/generate",
        _body({"inputs": "x", "parameters": {"max_new_tokens": 10**6}}),
        JSON,
        422,
    ),
    # accepted and ignored before: what Conveyor does not do is refused, saying so
    ("functions", CHAT, _body({"messages": HI, "functions": [{"name": "f"}]}), JSON, 422),
    # tools that are not tools, and tool choices that cannot be honoured
    ("tools-not-a-list", CHAT, _body({"messages": HI, "tools": {"type": "function"}}), JSON, 422),
    ("tool-without-function", CHAT, _body({"messages": HI, "tools": [{"type": "function"}]}), JSON, 422),
    ("tool-name-with-a-space", CHAT, _body({"messages": HI, "tools": [_tool("get weather")]}), JSON, 422),
    ("tool-name-with-a-newline", CHAT, _body({"messages": HI, "tools": [_tool("f\n")]}), JSON, 422),
    ("tool-parameters-a-list", CHAT, _body({"messages": HI, "tools": [_tool("f", [])]}), JSON, 422),
    ("tool-unknown-field", CHAT, _body({"messages": HI, "tools": [{**_tool("f"), "x": 1}]}), JSON, 422),
    ("tools-of-one-name", CHAT, _body({"messages": HI, "tools": [_tool("f"), _tool("f")]}), JSON, 422),
    ("tool-choice-without-tools", CHAT, _body({"messages": HI, "tool_choice": "required"}), JSON, 422),
    ("tool-choice-bogus", CHAT, _body({"messages": HI, "tools": [_tool("f")], "tool_choice": "always"}), JSON, 422),
    (
        "tool-choice-unknown-name",
        CHAT,
        _body({"messages": HI, "tools": [_tool("f")], "tool_choice": _named("g")}),
        JSON,
        422,
    ),
    (
        "forced-tool-with-bad-schema",
        CHAT,
        _body({"messages": HI, "tools": [_tool("f", {"type": "nope"})], "tool_choice": "required"}),
        JSON,
        422,
    ),
    (
        "forced-tool-schema-lone-surrogate",
        CHAT,
        _body({"messages": HI, "tools": [_tool("f", {"enum": ["\ud800"]})], "tool_choice": _named("f")}),
        JSON,
        422,
    ),
    (
        "forced-tool-and-response-format",
        CHAT,
        _body({**FORCED, "response_format": {"type": "json_object"}}),
        JSON,
        422,
    ),
    (
        "parallel-tool-calls-string",
        CHAT,
        _body({"messages": HI, "tools": [_tool("f")], "parallel_tool_calls": "yes"}),
        JSON,
        422,
    ),
    # tool messages and assistant tool calls
    ("tool-message-without-id", CHAT, _body({"messages": [*HI, {"role": "tool", "content": "1"}]}), JSON, 422),
    ("tool-call-id-not-a-string", CHAT, _body({"messages": [{**HI[0], "tool_call_id": 5}]}), JSON, 422),
    ("tool-calls-on-a-user-message", CHAT, _body({"messages": [{**HI[0], "tool_calls": [_call("{}")]}]}), JSON, 422),
    ("tool-calls-not-a-list", CHAT, _body({"messages": [*HI, _assistant(5)]}), JSON, 422),
    ("tool-call-without-function", CHAT, _body({"messages": [*HI, _assistant([{"id": "call_1"}])]}), JSON, 422),
    ("tool-call-arguments-not-json", CHAT, _body({"messages": [*HI, _assistant([_call("{city: Paris")])]}), JSON, 422),
    (
        "tool-call-arguments-100k-deep",
        CHAT,
        _body({"messages": [*HI, _assistant([_call("[" * 100_000 + "]" * 100_000)])]}),
        JSON,
        422,
    ),
    ("assistant-without-content-or-calls", CHAT, _body({"messages": [*HI, {"role": "assistant"}]}), JSON, 422),
    # constraints that are malformed, do not compile, or come two at a time
    ("response-format-xml", CHAT, _body({"messages": HI, "response_format": {"type": "xml"}}), JSON, 422),
    (
        "response-format-unknown-field",
        CHAT,
        _body({"messages": HI, "response_format": {"type": "json_object", "value": {"type": "string"}}}),
        JSON,
        422,
    ),
    ("json-schema-invalid", CHAT, _body({"messages": HI, "response_format": _schema({"type": "nope"})}), JSON, 422),
    ("json-schema-true", COMPLETIONS, _body({"prompt": "x", "guided_json": True}), JSON, 422),
    ("json-schema-text-true", COMPLETIONS, _body({"prompt": "x", "guided_json": "true"}), JSON, 422),
    (
        "json-schema-lone-surrogate",
        CHAT,
        _body({"messages": HI, "response_format": _schema({"enum": ["\ud800"]})}),
        JSON,
        422,
    ),
    ("json-schema-2^80", COMPLETIONS, _body({"prompt": "x", "guided_json": {"enum": [2**80]}}), JSON, 422),
    ("json-schema-text-100k-deep", COMPLETIONS, _body({"prompt": "x", "guided_json": "[" * 100_000}), JSON, 422),
    (
        "json-schema-unsatisfiable",
        COMPLETIONS,
        _body({"prompt": "x", "guided_json": {"minLength": 5, "maxLength": 2, "type": "string"}}),
        JSON,
        422,
    ),
    ("regex-invalid", COMPLETIONS, _body({"prompt": "x", "guided_regex": "(unclosed"}), JSON, 422),
    ("regex-lone-surrogate", COMPLETIONS, _body({"prompt": "x", "guided_regex": "\udfff"}), JSON, 422),
    ("regex-300kB", COMPLETIONS, _body({"prompt": "x", "guided_regex": "a" * 300_000}), JSON, 422),
    ("choice-empty", COMPLETIONS, _body({"prompt": "x", "guided_choice": []}), JSON, 422),
    ("choice-lone-surrogate", COMPLETIONS, _body({"prompt": "x", "guided_choice": ["\ud800"]}), JSON, 422),
    ("grammar-invalid", COMPLETIONS, _body({"prompt": "x", "guided_grammar": "start: nowhere"}), JSON, 422),
    ("two-constraints", COMPLETIONS, _body({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}), JSON, 422),
    (
        "response-format-and-structured-outputs",
        CHAT,
        _body({"messages": HI, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
        JSON,
        422,
    ),
    (
        "structured-outputs-two",
        COMPLETIONS,
        _body({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}),
        JSON,
        422,
    ),
    ("structured-outputs-regex-0", COMPLETIONS, _body({"prompt": "x", "structured_outputs": {"regex": 0}}), JSON, 422),
    (
        "structured-outputs-json-object-1",
        COMPLETIONS,
        _body({"prompt": "x", "structured_outputs": {"json_object": 1}}),
        JSON,
        422,
    ),
    (
        "tgi-grammar-unknown-type",
        "/generate",
        _body({"inputs": "x", "parameters": {"grammar": {"type": "xml", "value": "a"}}}),
        JSON,
        422,
    ),
    (
        "tgi-grammar-bad-regex",
        "/generate",
        _body({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "["}}}),
        JSON,
        422,
    ),
    ("logit-bias", COMPLETIONS, _body({"prompt": "x", "logit_bias": {"1": 100}}), JSON, 422),
    ("echo", COMPLETIONS, _body({"prompt": "x", "echo": True}), JSON, 422),
    ("unknown-openai-field", CHAT, _body({"messages": HI, "top_q": 5}), JSON, 422),
    ("unknown-message-field", CHAT, _body({"messages": [{"role": "user", "content": "x", "x": 1}]}), JSON, 422),
    (
        "stream-options-without-stream",
        CHAT,
        _body({"messages": HI, "stream_options": {"include_usage": True}}),
        JSON,
        422,
    ),
    ("unknown-tgi-parameter", "/generate", _body({"inputs": "x", "parameters": {"min_q": 0.1}}), JSON, 422),
    # bodies that are not JSON
    ("text-plain", "/generate", _body({"inputs": "x"}), {"Content-Type": "text/plain"}, 415),
    ("form", "/generate_stream", b"inputs=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("text-plain-openai", CHAT, _body({"messages": HI}), {"Content-Type": "text/plain"}, 415),
    ("json-latin1", "/tokenize", _body({"inputs": "x"}), {"Content-Type": "application/json; charset=latin-1"}, 415),
    ("bad-gzip", "/generate", b"not gzip", {**JSON, "Content-Encoding": "gzip"}, 400),
    (
        "gzip-bomb",
        "/generate",
        gzip.compress(b'{"inputs": "' + b"a" * 20_000_000 + b'"}'),
        {**JSON, "Content-Encoding": "gzip"},
        413,
    ),
    ("unknown-encoding", "/generate", b"xx", {**JSON, "Content-Encoding": "br"}, 400),
]


@pytest.mark.parametrize(("route", "body", "headers", "status"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_hostile_request_corpus(server: Server, route: str, body: bytes, headers: dict, status: int) -> None:
    with server.client(timeout=60) as client:
        response = client.post(route, content=body, headers=headers)
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    payload = response.json()
    assert set(payload) == {"error", "error_type"} and payload["error_type"]
    if route.startswith("/v1/"):
        assert payload["error"]["message"] and payload["error"]["type"] == "invalid_request_error"
    else:
        assert isinstance(payload["error"], str) and payload["error"]


def _raw_http(server: Server, request: bytes) -> bytes:
    """Sends bytes over a fresh connection and reads the whole answer (the server closes the connection)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


UNPARSABLE = [
    pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n", id="header-10kB"),
    pytest.param(b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", id="request-line-10kB"),
    pytest.param(
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(200)) + b"\r\n",
        id="200-headers",
    ),
    pytest.param(b"GARBAGE\r\n\r\n", id="not-http"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", id="negative-length"),
    pytest.param(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n", id="bad-chunk-size"
    ),
    pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\nX-\xff: \xfe\r\n\r\n", id="non-ascii-header-name"),
]


@pytest.mark.parametrize("request_bytes", UNPARSABLE)
def test_requests_aiohttp_cannot_parse_get_a_json_400(server: Server, request_bytes: bytes) -> None:
    """Answered by aiohttp's protocol handler before any route: still JSON, and a complete answer (the
    connection is closed after it, not dropped before it)."""
    head, _, body = _raw_http(server, request_bytes).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    assert status_line.split()[1] == "400", status_line
    assert any(line.lower().startswith("content-type: application/json") for line in header_lines)
    payload = json.loads(body)
    assert payload["error_type"] == "bad_request" and payload["error"]


ACCEPTED = [
    pytest.param("/generate", _body({"inputs": "x", "parameters": {"max_new_tokens": 2}}), {}, id="no-content-type"),
    pytest.param(
        "/generate",
        _body({"inputs": "x", "parameters": {"max_new_tokens": 2}}),
        {"Content-Type": "application/json; charset=UTF-8"},
        id="json-utf8",
    ),
    pytest.param(
        CHAT,
        _body(
            {"messages": HI, "max_tokens": 2, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
        ),
        JSON,
        id="neutral-tool-and-format-fields",
    ),
    pytest.param(
        CHAT,
        _body(
            {
                "messages": [
                    *HI,
                    _assistant([_call('{"a": 1}')]),
                    {"role": "tool", "tool_call_id": "call_1", "content": "2"},
                ],
                "tools": [_tool("f", {"type": "object"})],
                "parallel_tool_calls": None,
                "structured_outputs": {"json_object": False, "regex": None},
                "max_tokens": 2,
            }
        ),
        JSON,
        id="tool-round-trip-and-null-constraints",
    ),
    pytest.param(
        COMPLETIONS,
        _body({"prompt": "x", "max_tokens": 2, "model": "any", "user": "u", "logit_bias": {}, "best_of": 1}),
        JSON,
        id="ignored-fields",
    ),
    pytest.param(
        CHAT,
        _body({"messages": HI, "max_tokens": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}),
        JSON,
        id="tgi-sampling-fields-on-chat",
    ),
    pytest.param(
        "/generate",
        _body({"inputs": "x", "parameters": {"max_new_tokens": 2, "min_p": 0.1, "top_k": 0}}),
        JSON,
        id="min-p-and-top-k-zero",
    ),
    pytest.param(
        "/generate",
        gzip.compress(_body({"inputs": "x", "parameters": {"max_new_tokens": 2}})),
        {**JSON, "Content-Encoding": "gzip"},
        id="gzip",
    ),
]


@pytest.mark.parametrize(("route", "body", "headers"), ACCEPTED)
def test_what_is_not_hostile_is_still_served(server: Server, route: str, body: bytes, headers: dict) -> None:
    with server.client() as client:
        response = client.post(route, content=body, headers=headers)
    assert response.status_code == 200, response.text


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in a response")

    return json.loads(text, parse_constant=refuse)


def test_alternatives_a_warper_ruled_out_keep_responses_valid_json(server: Server) -> None:
    """top_k=1 leaves every alternative at -inf, which Python's json writes as `-Infinity` (not JSON): TGI's
    routes send null, OpenAI's -9999.0, as OpenAI does."""
    tgi = {"inputs": "def", "parameters": {"max_new_tokens": 2, "top_k": 1, "top_n_tokens": 3, "details": True}}
    chat = {"messages": HI, "max_tokens": 2, "top_p": 1e-9, "logprobs": True, "top_logprobs": 3}
    with server.client() as client:
        details = _strict_json(client.post("/generate", json=tgi).text)["details"]
        with client.stream("POST", "/generate_stream", json=tgi) as response:
            events = [_strict_json(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
        choice = _strict_json(client.post(CHAT, json=chat).text)["choices"][0]
        completion = _strict_json(
            client.post(COMPLETIONS, json={"prompt": "def", "max_tokens": 2, "top_p": 1e-9, "logprobs": 3}).text
        )
    assert [t["logprob"] for t in details["top_tokens"][0][1:]] == [None, None]
    assert all(e["top_tokens"][1]["logprob"] is None for e in events)
    assert [t["logprob"] for t in choice["logprobs"]["content"][0]["top_logprobs"][1:]] == [-9999.0, -9999.0]
    assert sorted(completion["choices"][0]["logprobs"]["top_logprobs"][0].values())[0] == -9999.0


def test_a_tiny_temperature_or_top_p_is_the_most_likely_token(server: Server) -> None:
    """Below ~1e-45 a float32 is 0, which the shard reads as "unset": `temperature: 1e-50` sampled at
    temperature 1. Such values now mean what they say: (nearly) always the most likely token."""
    body = {"inputs": "def f():", "parameters": {"max_new_tokens": 8}}
    with server.client() as client:
        greedy = client.post("/generate", json=body).json()["generated_text"]
        for tiny in ({"temperature": 1e-50}, {"top_p": 1e-50}, {"temperature": 1e-300, "top_p": 1e-300}):
            parameters = {**body["parameters"], **tiny, "seed": 1}
            assert client.post("/generate", json={**body, "parameters": parameters}).json()["generated_text"] == greedy


# --- gRPC front door -------------------------------------------------------------------------------------------


def _grpc_raw(server: Server, method: str, data: bytes) -> grpc.RpcError | bytes:
    with grpc.insecure_channel(server.grpc) as channel:
        streaming = method == "GenerateStream"
        call = (channel.unary_stream if streaming else channel.unary_unary)(
            f"/conveyor.v1.TextGeneration/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            answer = call(data, timeout=60)
            return b"".join(answer) if streaming else answer
        except grpc.RpcError as exc:
            return exc


def _grpc_corpus() -> list:
    from conveyor.v1 import generate_pb2 as pb

    def request(inputs: str = "x", **parameters: object) -> bytes:
        return pb.GenerateRequest(inputs=inputs, parameters=pb.Parameters(**parameters)).SerializeToString()

    valid = request(max_new_tokens=2)
    cases = {
        "not-protobuf": b"\xff\xff\xff\xff",
        "truncated": valid[:-1],
        "invalid-utf8-string": b"\x0a\x02\xff\xfe",
        "empty-inputs": b"",
        "nan-temperature": request(temperature=float("nan"), max_new_tokens=2),
        "inf-temperature": request(temperature=float("inf"), max_new_tokens=2),
        "huge-temperature": request(temperature=3e38, max_new_tokens=2),
        "negative-top-p": request(top_p=-1.0, max_new_tokens=2),
        "zero-max-new-tokens": request(max_new_tokens=0),
        "max-new-tokens-2^32": request(max_new_tokens=2**32 - 1),
        "top-n-tokens-1000": request(top_n_tokens=1000, max_new_tokens=2),
        "stop-100": request(stop=["a"] * 100, max_new_tokens=2),
        "empty-stop": request(stop=[""], max_new_tokens=2),
        "truncate-0": request(truncate=0, max_new_tokens=2),
        "regex-invalid": request(constraint=pb.Constraint(regex="(unclosed"), max_new_tokens=2),
        "json-schema-not-json": request(constraint=pb.Constraint(json_schema="{"), max_new_tokens=2),
        "json-schema-invalid": request(constraint=pb.Constraint(json_schema='{"type": "nope"}'), max_new_tokens=2),
        "choice-empty": request(constraint=pb.Constraint(choice=pb.Choices()), max_new_tokens=2),
        "grammar-invalid": request(constraint=pb.Constraint(grammar="start: nowhere"), max_new_tokens=2),
    }
    return [
        pytest.param(m, data, id=f"{m}-{name}") for m in ("Generate", "GenerateStream") for name, data in cases.items()
    ]


@pytest.mark.parametrize(("method", "data"), _grpc_corpus())
def test_grpc_hostile_requests_are_invalid_argument(server: Server, method: str, data: bytes) -> None:
    answer = _grpc_raw(server, method, data)
    assert isinstance(answer, grpc.RpcError), answer
    assert answer.code() is grpc.StatusCode.INVALID_ARGUMENT, answer.details()
    assert answer.details()


@pytest.mark.parametrize("method", ["Tokenize", "Info"])
def test_grpc_malformed_messages_are_invalid_argument(server: Server, method: str) -> None:
    answer = _grpc_raw(server, method, b"\xff\xff\xff")
    assert isinstance(answer, grpc.RpcError) and answer.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_everything_still_serves_after_the_corpus(server: Server) -> None:
    with server.client() as client:
        assert client.get("/health").status_code == 200
        body = {"inputs": "def f():", "parameters": {"max_new_tokens": 3, "details": True}}
        assert client.post("/generate", json=body).json()["details"]["generated_tokens"] == 3
        info = client.get("/info").json()
    assert info["kv_blocks_free"] == info["kv_blocks_total"]
    from conveyor.v1 import generate_pb2 as pb

    request = pb.GenerateRequest(inputs="x", parameters=pb.Parameters(max_new_tokens=2, details=True))
    answer = pb.GenerateResponse.FromString(_grpc_raw(server, "Generate", request.SerializeToString()))
    assert answer.details.generated_tokens == 2
