"""The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json`.

The request and answer schemas are generated from the types in `router/api/` (the ones the server validates
with), with the deployment's limits written in where a field declares one (`limited`). A request the document
allows is served, except where a rule depends on the prompt's tokens (its length, `inputs` tokens +
`max_new_tokens` within `max_total_tokens`) or is a rule between fields, which the types' docstrings (the
schemas' descriptions) state in words rather than in JSON Schema, where it would be written a second time.
`tests/e2e/test_openapi.py` checks that it validates, that it lists exactly the routes the app serves, and that real
responses match its schemas; `tests/faults/test_fuzz_api.py` runs schemathesis against it.

Server-sent events follow the convention of Open API 3.2 (and of Speakeasy and Stainless before it): the schema
of a `text/event-stream` response describes one event, `{"data": ...}`, whose `data` is JSON
(`contentMediaType` and `contentSchema`).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from conveyor.router.api import adapters, anthropic, embeddings, openai, responses_api, service, tgi
from conveyor.router.api.base import LIMIT
from conveyor.router.limits import Limits

# What the document says when it is built without a deployment's limits (the Config defaults).
DEFAULT_LIMITS = Limits(max_input_tokens=4095, max_total_tokens=4096)

SCHEMAS: dict[str, Any] = {
    "GenerateRequest": tgi.GenerateRequest,
    "PlainGenerateRequest": tgi.PlainGenerateRequest,
    "GenerateResponse": tgi.GenerateResponse,
    "StreamEvent": tgi.StreamEvent,
    "TokenizeResponse": list[tgi.TokenOffset],
    "Info": tgi.Info,
    "Health": tgi.Health,
    "Error": tgi.Error,
    "CompletionRequest": openai.CompletionRequest,
    "ChatRequest": openai.ChatRequest,
    "Completion": openai.Completion,
    "CompletionChunk": openai.CompletionChunk,
    "ChatCompletion": openai.ChatCompletion,
    "ChatCompletionChunk": openai.ChatCompletionChunk,
    "Models": openai.Models,
    "OpenAIError": openai.OpenAIError,
    "RequestList": service.RequestList,
    "Cancelled": service.Cancelled,
    "DashboardState": service.DashboardState,
    "GroupState": service.GroupState,
    "LoadAdapterRequest": adapters.LoadAdapterRequest,
    "UnloadAdapterRequest": adapters.UnloadAdapterRequest,
    "AdapterLoaded": adapters.AdapterLoaded,
    "AdapterUnloaded": adapters.AdapterUnloaded,
    "ResponsesRequest": responses_api.ResponsesRequest,
    "Response": responses_api.Response,
    "ResponseDeleted": responses_api.ResponseDeleted,
    "ResponseStreamEvent": responses_api.ResponseStreamEvent,
    "MessagesRequest": anthropic.MessagesRequest,
    "CountTokensRequest": anthropic.CountTokensRequest,
    "AnthropicMessage": anthropic.AnthropicMessage,
    "MessageTokensCount": anthropic.MessageTokensCount,
    "AnthropicError": anthropic.AnthropicError,
    "MessageStreamEvent": anthropic.MessageStreamEvent,
    "EmbeddingRequest": embeddings.EmbeddingRequest,
    "EmbeddingList": embeddings.EmbeddingList,
    "EmbedRequest": embeddings.TEIEmbedRequest,
    "Embeddings": list[list[float]],
    "TEIRerankRequest": embeddings.TEIRerankRequest,
    "TEIRanks": list[embeddings.TEIRank],
    "RerankRequest": embeddings.RerankRequest,
    "RerankList": embeddings.RerankList,
}


class _Untitled(GenerateJsonSchema):
    """No `title` on every field and type: the names say it already."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def typed_dict_schema(self, schema: Any) -> Any:
        result = super().typed_dict_schema(schema)
        result.pop("title", None)
        return result

    def model_schema(self, schema: Any) -> Any:
        result = super().model_schema(schema)
        result.pop("title", None)
        return result


@functools.cache
def _components() -> dict[str, Any]:
    """Every named schema, with `x-conveyor-limit` markers where the deployment's limits go."""
    inputs = [(name, "validation", TypeAdapter(kind)) for name, kind in SCHEMAS.items()]
    top, defs = TypeAdapter.json_schemas(
        inputs, ref_template="#/components/schemas/{model}", schema_generator=_Untitled
    )
    components = dict(defs.get("$defs", {}))
    for (name, _), schema in top.items():
        if schema != _ref(name):  # a model's own schema is among the definitions already
            components[name] = schema
    return components


def _with_limits(schema: Any, limits: Limits) -> Any:
    """A copy of `schema` with each `x-conveyor-limit` marker replaced by the deployment's bound: a list's
    `maxItems`, a number's `maximum`."""
    if isinstance(schema, list):
        return [_with_limits(item, limits) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _with_limits(value, limits) for key, value in schema.items() if key != LIMIT}
    if LIMIT in schema:
        name, minus = schema[LIMIT]
        _bound(out, getattr(limits, name) - minus)
    return out


def _bound(schema: dict[str, Any], bound: int) -> None:
    kinds = schema.get("type", ())
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if "array" in kinds:
        schema["maxItems"] = bound
    elif "integer" in kinds:
        schema["maximum"] = bound
    for branch in schema.get("anyOf", ()):
        _bound(branch, bound)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _events(*payloads: dict, done: bool = False) -> dict:
    """The schema of one server-sent event whose `data` is JSON matching one of `payloads` (or, with `done`,
    OpenAI's closing `[DONE]`)."""
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": payloads[0] if len(payloads) == 1 else {"oneOf": list(payloads)},
    }
    if done:
        data = {"oneOf": [{"const": "[DONE]"}, data]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _error(description: str, openai: bool) -> dict:
    return _json(_ref("OpenAIError" if openai else "Error"), description)


def _errors(openai: bool) -> dict:
    return {
        "400": _error("The body could not be read (a Content-Encoding that does not decode)", openai),
        "401": _error("Missing or wrong API key", openai),
        "404": _error(
            "The request names a LoRA adapter the server does not serve, or (/v1/responses) a stored response "
            "it does not have for this API key",
            openai,
        ),
        "413": _error("Request body too large (--payload-limit)", openai),
        "415": _error("The body is declared as something other than JSON", openai),
        "422": _error("Invalid input, or a prompt too long in tokens for the limits", openai),
        "424": _error("The generation failed", openai),
        "429": _error(
            "Too many requests in flight (--max-concurrent-requests, or the API key's max_concurrent)", openai
        ),
        "499": _error("Cancelled by its id (DELETE /v1/requests/{id}) before it finished", openai),
        "503": _error("The server is shutting down, or its shards are restarting", openai),
    }


def _anthropic_errors() -> dict:
    """Anthropic's routes answer every error in Anthropic's shape, and an invalid request 400 (not 422)."""
    errors = {status: _json(_ref("AnthropicError"), answer["description"]) for status, answer in _errors(True).items()}
    del errors["422"]
    errors["400"] = _json(
        _ref("AnthropicError"),
        "Invalid input, a prompt too long in tokens for the limits, or a body that could not be read",
    )
    errors["404"] = _json(_ref("AnthropicError"), "The request names a LoRA adapter the server does not serve")
    return errors


def _post(summary: str, request: str, ok: dict, openai: bool = False, errors: dict | None = None) -> dict:
    body = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    answers = errors if errors is not None else _errors(openai)
    return {"post": {"summary": summary, "requestBody": body, "responses": {"200": ok, **answers}}}


def _get(summary: str, ok: dict, **extra: dict) -> dict:
    return {"get": {"summary": summary, "responses": {"200": ok, **extra}}}


def _either(description: str, json_schema: dict, sse_schema: dict) -> dict:
    """A JSON answer, or server-sent events when the request's `stream` is true."""
    return {
        "description": description,
        "content": {"application/json": {"schema": json_schema}, "text/event-stream": {"schema": sse_schema}},
    }


def _adapter_route(summary: str, request: str, answer: str) -> dict:
    operation = _post(summary, request, _json(_ref(answer)))
    operation["post"]["responses"].update(
        {
            "400": _error("The adapter does not fit the base model, or its files cannot be read", False),
            "403": _error("Not an admin key", False),
            "404": _error("No adapter of that name is served", False),
            "409": _error("The name is taken, --max-loras are resident, or requests use the adapter", False),
        }
    )
    return operation


def document(version: str, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    stream_event = _events(_ref("StreamEvent"), _ref("Error"))
    compat = _either(
        "A one-item list, or server-sent events when `stream` is true",
        {"type": "array", "items": _ref("GenerateResponse"), "minItems": 1, "maxItems": 1},
        stream_event,
    )
    completion = _either(
        "The completion, or server-sent chunks ending with `data: [DONE]` when `stream` is true",
        _ref("Completion"),
        _events(_ref("CompletionChunk"), _ref("OpenAIError"), done=True),
    )
    chat = _either(
        "The chat completion, or server-sent chunks ending with `data: [DONE]` when `stream` is true",
        _ref("ChatCompletion"),
        _events(_ref("ChatCompletionChunk"), _ref("OpenAIError"), done=True),
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Conveyor",
            "version": version,
            "description": "LLM text generation with continuous batching: TGI's API, OpenAI's and Anthropic's "
            "Messages; embeddings and rerank (OpenAI's, TEI's and the Cohere/Jina shape). Request bodies are JSON "
            "(Content-Type application/json, or none). The schemas are the server's "
            "own types, with this deployment's limits; what they cannot state is a 422 too (a 400 on Anthropic's "
            "routes): a prompt of more tokens than "
            "max_input_tokens, inputs + new tokens beyond max_total_tokens, and the rules between fields given in "
            "each request's description. An integer is a JSON integer: 5.0 is refused where one is expected. A "
            "null in an optional field is the same as leaving the field out.",
        },
        "paths": {
            "/": _post("TGI compatibility route (stream picks the shape)", "GenerateRequest", compat),
            "/generate": _post("Generate text", "PlainGenerateRequest", _json(_ref("GenerateResponse"))),
            "/generate_stream": _post(
                "Generate text as server-sent events",
                "GenerateRequest",
                {
                    "description": "One event per token; a failure after the stream started ends it with an error",
                    "content": {"text/event-stream": {"schema": stream_event}},
                },
            ),
            "/tokenize": _post("Tokenize a prompt", "GenerateRequest", _json(_ref("TokenizeResponse"))),
            "/v1/completions": _post("OpenAI completions", "CompletionRequest", completion, openai=True),
            "/v1/chat/completions": _post("OpenAI chat completions", "ChatRequest", chat, openai=True),
            "/v1/models": _get("The served model, OpenAI-style", _json(_ref("Models"))),
            "/v1/embeddings": _post(
                "OpenAI embeddings: one vector per input (--task embed; 422 on a deployment without it)",
                "EmbeddingRequest",
                _json(_ref("EmbeddingList")),
                openai=True,
            ),
            "/embed": _post(
                "TEI's embeddings: one vector per input (--task embed)", "EmbedRequest", _json(_ref("Embeddings"))
            ),
            "/rerank": _post(
                "TEI's rerank: every text scored against the query, best first (--task rerank)",
                "TEIRerankRequest",
                _json(_ref("TEIRanks")),
            ),
            "/v1/rerank": _post(
                "Rerank in the Cohere/Jina shape: the best `top_n` documents for the query (--task rerank)",
                "RerankRequest",
                _json(_ref("RerankList")),
                openai=True,
            ),
            "/health": _get(
                "200 once the shards answer", _json(_ref("Health")), **{"503": _json(_ref("Error"), "Not ready")}
            ),
            "/info": _get("Model, engine and limits", _json(_ref("Info"))),
            "/metrics": _get(
                "Prometheus metrics",
                {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            ),
            "/v1/requests": _get(
                "The caller's requests queued or running (every key's, for an admin key)",
                _json(_ref("RequestList")),
                **{"401": _error("Missing or wrong API key", False)},
            ),
            "/v1/requests/{id}": {
                "delete": {
                    "summary": "Cancel a queued or running request by its X-Request-Id",
                    "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {
                        "200": _json(_ref("Cancelled")),
                        "401": _error("Missing or wrong API key", False),
                        "404": _error("No such request in flight for this API key", False),
                    },
                }
            },
            "/v1/responses": _post(
                "OpenAI's Responses API: a response to input items, with function tools and JSON schemas",
                "ResponsesRequest",
                _either(
                    "The response, or its typed events (server-sent) when `stream` is true",
                    _ref("Response"),
                    _events(_ref("ResponseStreamEvent")),
                ),
                openai=True,
            ),
            "/v1/messages": _post(
                "Anthropic's Messages API: a message in answer to a conversation, with client tools",
                "MessagesRequest",
                _either(
                    "The message, or its events (server-sent) when `stream` is true",
                    _ref("AnthropicMessage"),
                    _events(_ref("MessageStreamEvent")),
                ),
                errors=_anthropic_errors(),
            ),
            "/v1/messages/count_tokens": _post(
                "The prompt tokens /v1/messages would run for these messages, system prompt and tools",
                "CountTokensRequest",
                _json(_ref("MessageTokensCount")),
                errors=_anthropic_errors(),
            ),
            "/v1/responses/{id}": {
                method: {
                    "summary": summary,
                    "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {
                        "200": _json(_ref(answer)),
                        "401": _error("Missing or wrong API key", True),
                        "404": _error("No stored response of that id for this API key", True),
                    },
                }
                for method, summary, answer in (
                    ("get", "A stored response", "Response"),
                    ("delete", "Delete a stored response", "ResponseDeleted"),
                )
            },
            "/v1/load_lora_adapter": _adapter_route(
                "Load a LoRA adapter on every shard (an admin key's)", "LoadAdapterRequest", "AdapterLoaded"
            ),
            "/v1/unload_lora_adapter": _adapter_route(
                "Unload a LoRA adapter no request uses (an admin key's)", "UnloadAdapterRequest", "AdapterUnloaded"
            ),
            **{
                f"/admin/groups/{{index}}/{action}": {
                    "post": {
                        "summary": summary,
                        "parameters": [
                            {"name": "index", "in": "path", "required": True, "schema": {"type": "integer"}}
                        ],
                        "responses": {
                            "200": _json(_ref("GroupState")),
                            "401": _error("Missing or wrong API key", False),
                            "403": _error("Not an admin key", False),
                            "404": _error("No shard group of that index", False),
                            "409": _error("Draining the only group that serves (it would stop the server)", False),
                        },
                    }
                }
                for action, summary in (
                    (
                        "drain",
                        "Take a shard group out of placement: its waiting requests move, its running ones finish",
                    ),
                    ("resume", "Put a drained shard group back in placement"),
                )
            },
            "/dashboard": _get(
                "The live dashboard: one self-contained HTML page that polls /dashboard/state",
                {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}},
            ),
            "/dashboard/state": _get(
                "What the dashboard shows: the model, queue, batch, KV pool, throughput, latencies and the "
                "caller's requests (every key's, for an admin key)",
                _json(_ref("DashboardState")),
                **{"401": _error("Missing or wrong API key", False)},
            ),
            "/openapi.json": _get(
                "This document",
                {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
            ),
        },
        "components": {"schemas": _with_limits(_components(), limits)},
    }
