"""`/openapi.json` validates, lists exactly the routes the app serves, and real responses match its schemas."""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from conftest import Server
from openapi_spec_validator import validate

from conveyor.keys import KeyRing
from conveyor.router.frontends.app import HttpServer
from conveyor.router.frontends.connections import ConnectionLimits


def fetch(server: Server) -> dict:
    return httpx.get(f"{server.url}/openapi.json").json()


def check(document: dict, schema_name: str, instance: object) -> None:
    """Validates `instance` against a component schema, resolving references within the document."""
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]}
    jsonschema.validate(instance, schema)


def test_the_document_is_valid_openapi(server: Server) -> None:
    validate(fetch(server))


def test_it_lists_every_route_the_app_serves(server: Server) -> None:
    app = HttpServer.__new__(HttpServer)  # the routing table only: no model, no shards
    app.infer = app.validation = app.tasks = None
    app.info = type("Info", (), {"model_id": "m"})()
    app.keys, app.payload_limit, app.draining = KeyRing(), 1, False
    app.connections, app.metrics_keys = ConnectionLimits(), None
    served = {
        (route.resource.canonical, route.method.lower())
        for route in app.app().router.routes()
        if route.method != "HEAD"
    }
    documented = {(path, method) for path, item in fetch(server)["paths"].items() for method in item}
    assert documented == served


def test_real_responses_match_the_schemas(server: Server) -> None:
    document = fetch(server)
    body = {
        "inputs": "def f():",
        "parameters": {"max_new_tokens": 3, "details": True, "top_n_tokens": 2, "decoder_input_details": True},
    }
    check(document, "GenerateResponse", httpx.post(f"{server.url}/generate", json=body, timeout=60).json())
    check(document, "Info", httpx.get(f"{server.url}/info").json())
    check(document, "Health", httpx.get(f"{server.url}/health").json())
    check(document, "TokenizeResponse", httpx.post(f"{server.url}/tokenize", json={"inputs": "x"}).json())
    check(document, "Error", httpx.post(f"{server.url}/generate", json={"inputs": ""}).json())
    check(document, "Models", httpx.get(f"{server.url}/v1/models").json())
    completion = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).json()
    check(document, "Completion", completion)
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    ).json()
    check(document, "ChatCompletion", chat)
    with httpx.stream(
        "POST", f"{server.url}/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}, timeout=60
    ) as response:
        events = [line[5:] for line in response.iter_lines() if line.startswith("data:")]
    for event in events:
        check(document, "StreamEvent", httpx.Response(200, content=event).json())


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "pick",
            "description": "Picks a digit",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]
HI = [{"role": "user", "content": "x"}]


def _events(server: Server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        lines = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    return [httpx.Response(200, content=line).json() for line in lines if line != "[DONE]"]


def test_tool_calls_and_structured_output_match_the_schemas(server: Server) -> None:
    """Responses with tool calls (null content, `tool_calls`, finish_reason tool_calls), streamed and not, and
    constrained ones on every route; and the requests that produce them are ones the document allows."""
    document = fetch(server)
    for tool_choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        body = {"messages": HI, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 40, "temperature": 0}
        check(document, "ChatRequest", body)
        chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        check(document, "ChatCompletion", chat)
        assert chat["choices"][0]["finish_reason"] == "tool_calls" and chat["choices"][0]["message"]["content"] is None
        chunks = _events(server, "/v1/chat/completions", {**body, "stream": True})
        for chunk in chunks:
            check(document, "ChatCompletionChunk", chunk)
        assert any(c["choices"] and "tool_calls" in c["choices"][0]["delta"] for c in chunks)
    call = chat["choices"][0]["message"]["tool_calls"][0]
    answer = {"role": "tool", "tool_call_id": call["id"], "content": "7"}
    follow_up = {"messages": [*HI, chat["choices"][0]["message"], answer], "tools": TOOLS, "max_tokens": 2}
    check(document, "ChatRequest", follow_up)
    check(
        document, "ChatCompletion", httpx.post(f"{server.url}/v1/chat/completions", json=follow_up, timeout=60).json()
    )
    constrained = {"prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{1,3}"}
    check(document, "CompletionRequest", constrained)
    check(document, "Completion", httpx.post(f"{server.url}/v1/completions", json=constrained, timeout=60).json())
    tgi = {"inputs": "x", "parameters": {"max_new_tokens": 8, "grammar": {"type": "choice", "value": ["a", "b"]}}}
    check(document, "GenerateRequest", tgi)
    check(document, "GenerateResponse", httpx.post(f"{server.url}/generate", json=tgi, timeout=60).json())


def test_the_document_refuses_what_the_server_refuses() -> None:
    """A few bodies the server answers with a 422, which the schemas (built without a server) refuse as well."""
    from conveyor.router.frontends.openapi import document

    components = document("test")["components"]
    refused = {
        "ChatRequest": [
            {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            {"messages": HI, "response_format": {"type": "json_object", "schema": {}}},
            {"messages": HI, "tools": [{"type": "function", "function": {"name": "get weather"}}]},
            {"messages": [{"role": "robot", "content": "x"}]},
            {"messages": HI, "top_q": 0.5},
        ],
        "CompletionRequest": [
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            {"prompt": "x", "echo": True},
            {"prompt": []},
        ],
        "GenerateRequest": [
            {"inputs": "x", "parameters": {"grammar": {"type": "regex"}}},
            {"inputs": "x", "parameters": {"min_q": 0.1}},
            {"inputs": "x", "parameters": {"top_k": -1}},
        ],
    }
    for name, bodies in refused.items():
        validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})
        for body in bodies:
            assert not validator.is_valid(body), body


IN_WORDS = [
    # (schema, a body the server refuses for a rule between fields, the words that state the rule there)
    ("ChatRequest", {"messages": HI, "tool_choice": "required"}, "needs `tools`"),
    ("ChatRequest", {"messages": HI, "top_logprobs": 2}, "`top_logprobs` needs `logprobs: true`"),
    ("ChatRequest", {"messages": HI, "max_tokens": 2, "max_completion_tokens": 3}, "are equal"),
    ("ChatRequest", {"messages": HI, "stream_options": {"include_usage": True}}, "`stream_options`"),
    ("ChatRequest", {"messages": HI, "guided_regex": "a", "guided_choice": ["a"]}, "cannot come with another"),
    ("CompletionRequest", {"prompt": "x", "stream_options": {"include_usage": True}}, "`stream_options`"),
    ("CompletionRequest", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "constraint"),
    ("StructuredOutputs", {"regex": "a", "choice": ["a"]}, "one of"),
    ("Message", {"role": "tool", "content": "1"}, "`tool_call_id`"),
    ("Message", {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "assistant"),
    ("Message", {"role": "user"}, "needs a string `content`"),
]


@pytest.mark.parametrize(("name", "body", "words"), IN_WORDS, ids=[f"{n}-{w}" for n, _, w in IN_WORDS])
def test_rules_between_fields_are_stated_in_words(name: str, body: dict, words: str) -> None:
    """Rules between fields are not in the schemas (schema-based generators could not draw from them): the
    server refuses such bodies, and the schema's description states the rule (a 422 from one of them is among the
    answers `tests/faults/test_fuzz_api.py` expects for a body the document allows)."""
    from conveyor.router.api import constraints, openai
    from conveyor.router.api.base import ValidationError, parse
    from conveyor.router.frontends.openapi import document

    components = document("test")["components"]["schemas"]
    models = {
        "ChatRequest": openai.ChatRequest,
        "CompletionRequest": openai.CompletionRequest,
        "StructuredOutputs": constraints.StructuredOutputs,
        "Message": openai.Message,
    }
    with pytest.raises(ValidationError):
        parse(models[name], body)
    assert words in " ".join(components[name].get("description", "").split())


LIMITS_BODIES = [
    # (schema, body, whether the server takes it), with Limits(32, 64, max_stop_sequences=2, max_top_n_tokens=3)
    ("GenerateRequest", {"inputs": "x", "parameters": {"top_k": 0, "min_p": 0.1}}, True),
    ("GenerateRequest", {"inputs": "x", "parameters": {"top_k": -1}}, False),
    ("GenerateRequest", {"inputs": "x", "parameters": {"min_q": 0.1}}, False),
    ("GenerateRequest", {"inputs": "x", "parameters": {"best_of": 2}}, False),
    ("GenerateRequest", {"inputs": "x", "parameters": {"best_of": 1, "watermark": False, "adapter_id": None}}, True),
    ("GenerateRequest", {"inputs": "x", "parameters": {"stop": ["a", "b"], "max_new_tokens": 63}}, True),
    ("GenerateRequest", {"inputs": "x", "parameters": {"stop": ["a", "b", "c"]}}, False),
    ("GenerateRequest", {"inputs": "x", "parameters": {"max_new_tokens": 64}}, False),
    ("GenerateRequest", {"inputs": "x", "parameters": {"truncate": 33}}, False),
    ("GenerateRequest", {"inputs": "x", "parameters": {"top_n_tokens": 4}}, False),
    ("GenerateRequest", {"inputs": "x", "parameters": {"temperature": None, "top_k": None}}, True),
    ("ChatRequest", {"messages": HI, "top_k": 5, "min_p": 0.1, "typical_p": 0.9, "repetition_penalty": 1.1}, True),
    ("ChatRequest", {"messages": HI, "top_q": 5}, False),
    ("ChatRequest", {"messages": HI, "temperature": 0, "top_k": 0}, True),
    ("ChatRequest", {"messages": HI, "stop": ["a", "b", "c"]}, False),
    ("ChatRequest", {"messages": HI, "max_tokens": 64}, False),
    ("ChatRequest", {"messages": HI, "max_completion_tokens": 63}, True),
    ("ChatRequest", {"messages": HI, "logprobs": True, "top_logprobs": 4}, False),
    ("ChatRequest", {"messages": HI, "logit_bias": {"1": 1}}, False),
    ("ChatRequest", {"messages": HI, "functions": [{"name": "f"}]}, False),
    ("CompletionRequest", {"prompt": "x", "logprobs": 3, "stop": "abc"}, True),
    ("CompletionRequest", {"prompt": "x", "logprobs": 4}, False),
    ("CompletionRequest", {"prompt": "x", "echo": True}, False),
]


def test_the_document_states_the_deployments_limits_as_the_server_applies_them() -> None:
    """The `limited` bounds written in from the deployment's limits, refused and unsupported fields, and the
    sampling fields both APIs share: the document and the server's two stages (schema, then `check_limits`) give
    the same verdict."""
    from conveyor.router.api import openai, tgi
    from conveyor.router.api.base import ValidationError, parse
    from conveyor.router.frontends.openapi import document
    from conveyor.router.limits import Limits
    from conveyor.router.pipeline.validation import check_limits

    limits = Limits(max_input_tokens=32, max_total_tokens=64, max_stop_sequences=2, max_top_n_tokens=3)
    components = document("test", limits)["components"]
    models = {"GenerateRequest": tgi.GenerateRequest, "ChatRequest": openai.ChatRequest}
    models["CompletionRequest"] = openai.CompletionRequest
    for name, body, taken in LIMITS_BODIES:
        validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})
        assert validator.is_valid(body) == taken, body
        try:
            request = parse(models[name], body)
            if name == "GenerateRequest":
                check_limits(request.parameters, limits, "parameters.")
            else:
                check_limits(request, limits)
        except ValidationError:
            assert not taken, body
        else:
            assert taken, body
