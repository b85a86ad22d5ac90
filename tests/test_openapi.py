"""`/openapi.json` validates, lists exactly the routes the app serves, and real responses match its schemas."""

from __future__ import annotations

import httpx
import jsonschema
from conftest import Server
from conveyor.router.http import HttpServer
from openapi_spec_validator import validate


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
    app.infer = app.validation = None
    app.info = type("Info", (), {"model_id": "m"})()
    app.api_key, app.payload_limit, app.draining = None, 1, False
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
