"""The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json`.

Written by hand next to the routes it describes; `tests/test_openapi.py` checks that it validates, that it
lists exactly the routes the app serves, and that real responses match its schemas.
"""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _sse(description: str) -> dict:
    return {"description": description, "content": {"text/event-stream": {"schema": {"type": "string"}}}}


ERRORS = {
    "401": _json(_ref("Error"), "Missing or wrong API key"),
    "413": _json(_ref("Error"), "Request body too large"),
    "422": _json(_ref("Error"), "Invalid input"),
    "424": _json(_ref("Error"), "The generation failed"),
    "429": _json(_ref("Error"), "Too many requests in flight"),
}

NUMBER = {"type": ["number", "null"]}
INTEGER = {"type": ["integer", "null"]}
BOOLEAN = {"type": ["boolean", "null"]}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error", "error_type"],
        "properties": {"error": {}, "error_type": {"type": "string"}},
    },
    "GenerateParameters": {
        "type": "object",
        "properties": {
            "max_new_tokens": INTEGER,
            "do_sample": BOOLEAN,
            "temperature": NUMBER,
            "top_k": INTEGER,
            "top_p": NUMBER,
            "typical_p": NUMBER,
            "repetition_penalty": NUMBER,
            "frequency_penalty": NUMBER,
            "presence_penalty": NUMBER,
            "seed": INTEGER,
            "stop": {"type": ["array", "null"], "items": {"type": "string"}},
            "truncate": INTEGER,
            "details": BOOLEAN,
            "decoder_input_details": BOOLEAN,
            "return_full_text": BOOLEAN,
            "top_n_tokens": INTEGER,
            "ignore_eos": BOOLEAN,
            "best_of": INTEGER,
            "watermark": BOOLEAN,
        },
    },
    "GenerateRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {"inputs": {"type": "string"}, "parameters": _ref("GenerateParameters"), "stream": BOOLEAN},
    },
    "Token": {
        "type": "object",
        "required": ["id", "text", "logprob"],
        "properties": {
            "id": {"type": "integer"},
            "text": {"type": "string"},
            "logprob": NUMBER,
            "special": {"type": "boolean"},
        },
    },
    "Details": {
        "type": "object",
        "required": ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"],
        "properties": {
            "finish_reason": {"enum": ["length", "eos_token", "stop_sequence"]},
            "generated_tokens": {"type": "integer"},
            "seed": INTEGER,
            "prefill": {"type": "array", "items": _ref("Token")},
            "tokens": {"type": "array", "items": _ref("Token")},
            "top_tokens": {"type": "array", "items": {"type": "array", "items": _ref("Token")}},
        },
    },
    "GenerateResponse": {
        "type": "object",
        "required": ["generated_text"],
        "properties": {"generated_text": {"type": "string"}, "details": _ref("Details")},
    },
    "StreamEvent": {
        "description": "One `data:` line per token; the last has generated_text (and details when asked).",
        "type": "object",
        "required": ["index", "token", "generated_text", "details"],
        "properties": {
            "index": {"type": "integer"},
            "token": _ref("Token"),
            "top_tokens": {"type": "array", "items": _ref("Token")},
            "generated_text": {"type": ["string", "null"]},
            "details": {"type": ["object", "null"]},
        },
    },
    "TokenizeResponse": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["id", "text", "start", "stop"],
            "properties": {
                "id": {"type": "integer"},
                "text": {"type": "string"},
                "start": {"type": "integer"},
                "stop": {"type": "integer"},
            },
        },
    },
    "Info": {
        "type": "object",
        "required": ["model_id", "model_dtype", "engine", "max_input_tokens", "max_total_tokens", "version"],
        "properties": {
            "model_id": {"type": "string"},
            "model_dtype": {"type": "string"},
            "engine": {"type": "string"},
            "max_input_tokens": {"type": "integer"},
            "max_total_tokens": {"type": "integer"},
            "max_concurrent_requests": {"type": "integer"},
            "max_batch_total_tokens": {"type": "integer"},
            "num_shard": {"type": "integer"},
            "version": {"type": "string"},
            "kv_blocks_free": {"type": "integer"},
            "kv_blocks_total": {"type": "integer"},
        },
    },
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "max_tokens": INTEGER,
            "temperature": NUMBER,
            "top_p": NUMBER,
            "seed": INTEGER,
            "n": INTEGER,
            "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
            "logprobs": INTEGER,
            "presence_penalty": NUMBER,
            "frequency_penalty": NUMBER,
            "stream": BOOLEAN,
            "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
        },
    },
    "ChatRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": {"type": "string"}},
                },
            },
            "max_tokens": INTEGER,
            "max_completion_tokens": INTEGER,
            "temperature": NUMBER,
            "top_p": NUMBER,
            "seed": INTEGER,
            "n": INTEGER,
            "logprobs": BOOLEAN,
            "top_logprobs": INTEGER,
            "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
            "presence_penalty": NUMBER,
            "frequency_penalty": NUMBER,
            "stream": BOOLEAN,
            "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
        },
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {"object": {"const": "text_completion"}, "choices": {"type": "array"}, "usage": _ref("Usage")},
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {"object": {"const": "chat.completion"}, "choices": {"type": "array"}, "usage": _ref("Usage")},
    },
    "Models": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {"type": "object", "required": ["id", "object"], "properties": {"id": {"type": "string"}}},
            },
        },
    },
}


def _post(summary: str, request: str, ok: dict) -> dict:
    body = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    return {"post": {"summary": summary, "requestBody": body, "responses": {"200": ok, **ERRORS}}}


def _get(summary: str, ok: dict, **extra: dict) -> dict:
    return {"get": {"summary": summary, "responses": {"200": ok, **extra}}}


def document(version: str) -> dict[str, Any]:
    generate = _json(_ref("GenerateResponse"))
    either = {
        "description": "A one-item list, or server-sent events when `stream` is true",
        "content": {
            "application/json": {"schema": {"type": "array", "items": _ref("GenerateResponse")}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    openai_ok = {"description": "The completion, or server-sent chunks ending with `data: [DONE]` when streaming"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Conveyor",
            "version": version,
            "description": "LLM text generation with continuous batching: TGI's API and OpenAI's.",
        },
        "paths": {
            "/": _post("TGI compatibility route (stream picks the shape)", "GenerateRequest", either),
            "/generate": _post("Generate text", "GenerateRequest", generate),
            "/generate_stream": _post(
                "Generate text as server-sent events", "GenerateRequest", _sse("One `data: StreamEvent` per token")
            ),
            "/tokenize": _post("Tokenize a prompt", "GenerateRequest", _json(_ref("TokenizeResponse"))),
            "/v1/completions": _post(
                "OpenAI completions", "CompletionRequest", {**openai_ok, **_json(_ref("Completion"))}
            ),
            "/v1/chat/completions": _post(
                "OpenAI chat completions", "ChatRequest", {**openai_ok, **_json(_ref("ChatCompletion"))}
            ),
            "/v1/models": _get("The served model, OpenAI-style", _json(_ref("Models"))),
            "/health": _get(
                "200 once the shards answer", _json(_ref("Health")), **{"503": _json(_ref("Error"), "Not ready")}
            ),
            "/info": _get("Model, engine and limits", _json(_ref("Info"))),
            "/metrics": _get(
                "Prometheus metrics",
                {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            ),
            "/openapi.json": _get(
                "This document",
                {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
            ),
        },
        "components": {"schemas": SCHEMAS},
    }
