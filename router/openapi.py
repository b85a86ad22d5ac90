"""The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json`.

Written by hand next to the routes it describes, and as strict as the server: a request the document allows is
served, except where a rule cannot be written in JSON Schema (the prompt's length in tokens, `inputs` tokens +
`max_new_tokens` within `max_total_tokens`, prompts times `n` within 8, a chat template that cannot render the
messages), and one it forbids is refused with a 4xx. The limits that depend on the deployment (stop sequences,
alternatives per token, `truncate`) are the server's own. `tests/test_openapi.py` checks that it validates, that
it lists exactly the routes the app serves, and that real responses match its schemas;
`tests/faults/test_fuzz_api.py` runs schemathesis against it.

Server-sent events follow the convention of Open API 3.2 (and of Speakeasy and Stainless before it): the schema
of a `text/event-stream` response describes one event, `{"data": ...}`, whose `data` is JSON
(`contentMediaType` and `contentSchema`).
"""

from __future__ import annotations

from typing import Any

from conveyor.router.openai import MAX_CHOICES, MAX_MESSAGES, MAX_TEMPERATURE
from conveyor.router.validation import (
    MAX_REPETITION_PENALTY,
    SEED_LIMIT,
    UINT32_MAX,
    Limits,
)
from conveyor.router.validation import (
    MAX_TEMPERATURE as MAX_TGI_TEMPERATURE,
)

# What the document says when it is built without a deployment's limits (the Config defaults).
DEFAULT_LIMITS = Limits(max_input_tokens=4095, max_total_tokens=4096)


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


def _sse(description: str, *payloads: dict, done: bool = False) -> dict:
    return {"description": description, "content": {"text/event-stream": {"schema": _events(*payloads, done=done)}}}


def _nullable(schema: dict) -> dict:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {**schema, "type": [kind, "null"]}
    return {"oneOf": [schema, {"type": "null"}]}


def _number(minimum: float | None = None, maximum: float | None = None, exclusive_minimum: float | None = None):
    schema: dict[str, Any] = {"type": "number"}
    if minimum is not None:
        schema["minimum"] = minimum
    if exclusive_minimum is not None:
        schema["exclusiveMinimum"] = exclusive_minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return _nullable(schema)


def _integer(minimum: int | None = None, maximum: int | None = None) -> dict:
    schema: dict[str, Any] = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return _nullable(schema)


BOOLEAN = {"type": ["boolean", "null"]}
TEXT = {"type": "string", "minLength": 1}
PENALTY = _number(-2.0, 2.0)
PROBABILITY = _number(maximum=1.0, exclusive_minimum=0.0)
SEED = _integer(0, SEED_LIMIT - 1)


def _error(description: str, openai: bool) -> dict:
    return _json(_ref("OpenAIError" if openai else "Error"), description)


def _errors(openai: bool) -> dict:
    return {
        "400": _error("The body could not be read (a Content-Encoding that does not decode)", openai),
        "401": _error("Missing or wrong API key", openai),
        "413": _error("Request body too large (--payload-limit)", openai),
        "415": _error("The body is declared as something other than JSON", openai),
        "422": _error("Invalid input, or a prompt too long in tokens for the limits", openai),
        "424": _error("The generation failed", openai),
        "429": _error("Too many requests in flight (--max-concurrent-requests)", openai),
        "503": _error("The server is shutting down, or its shards are restarting", openai),
    }


def _tgi_schemas(limits: Limits) -> dict[str, Any]:
    return {
        "Error": {
            "type": "object",
            "required": ["error", "error_type"],
            "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
        },
        "GenerateParameters": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {
                "max_new_tokens": _integer(1, limits.max_total_tokens - 1),
                "do_sample": BOOLEAN,
                "temperature": _number(maximum=MAX_TGI_TEMPERATURE, exclusive_minimum=0.0),
                "top_k": _integer(1, UINT32_MAX),
                "top_p": PROBABILITY,
                "typical_p": PROBABILITY,
                "repetition_penalty": _number(maximum=MAX_REPETITION_PENALTY, exclusive_minimum=0.0),
                "frequency_penalty": PENALTY,
                "presence_penalty": PENALTY,
                "seed": SEED,
                "stop": _nullable({"type": "array", "maxItems": limits.max_stop_sequences, "items": TEXT}),
                "truncate": _integer(1, limits.max_input_tokens),
                "details": BOOLEAN,
                "decoder_input_details": {
                    **BOOLEAN,
                    "description": "Prompt log-probabilities; not with streaming (422)",
                },
                "return_full_text": BOOLEAN,
                "top_n_tokens": _integer(0, limits.max_top_n_tokens),
                "ignore_eos": BOOLEAN,
                "best_of": {"enum": [1, None], "description": "Only 1: Conveyor has no best-of sampling"},
                "watermark": {"enum": [False, None], "description": "Conveyor does not watermark"},
                "grammar": {"type": "null", "description": "Conveyor has no guided decoding"},
                "adapter_id": {"type": "null", "description": "Conveyor serves no adapters"},
            },
        },
        "GenerateRequest": {
            "type": "object",
            "additionalProperties": False,
            "required": ["inputs"],
            "properties": {
                "inputs": {
                    **TEXT,
                    "description": f"At most {limits.max_input_tokens} tokens (after `truncate`), and "
                    f"inputs tokens + max_new_tokens <= {limits.max_total_tokens} (else 422)",
                },
                "parameters": _ref("GenerateParameters"),
                "stream": BOOLEAN,
            },
        },
        "Token": {
            "type": "object",
            "required": ["id", "text", "logprob"],
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "text": {"type": "string"},
                "logprob": {
                    "type": ["number", "null"],
                    "description": "null where there is none (-inf, or the first prompt token)",
                },
                "special": {"type": "boolean"},
            },
        },
        "Details": {
            "type": "object",
            "required": ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"],
            "properties": {
                "finish_reason": {"enum": ["length", "eos_token", "stop_sequence"]},
                "generated_tokens": {"type": "integer", "minimum": 1},
                "seed": {"type": ["integer", "null"]},
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
        "StreamDetails": {
            "type": ["object", "null"],
            "required": ["finish_reason", "generated_tokens", "seed", "input_length"],
            "properties": {
                "finish_reason": {"enum": ["length", "eos_token", "stop_sequence"]},
                "generated_tokens": {"type": "integer", "minimum": 1},
                "seed": {"type": ["integer", "null"]},
                "input_length": {"type": "integer", "minimum": 1},
            },
        },
        "StreamEvent": {
            "description": "The JSON of one `data:` line per token; the last has generated_text (and details when "
            "asked). A stream that fails after it started ends with an `Error` event instead.",
            "type": "object",
            "required": ["index", "token", "generated_text", "details"],
            "properties": {
                "index": {"type": "integer", "minimum": 1},
                "token": _ref("Token"),
                "top_tokens": {"type": "array", "items": _ref("Token")},
                "generated_text": {"type": ["string", "null"]},
                "details": _ref("StreamDetails"),
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
    }


def _openai_request(limits: Limits, **fields: dict) -> dict:
    stop = {"oneOf": [TEXT, {"type": "array", "maxItems": limits.max_stop_sequences, "items": TEXT}, {"type": "null"}]}
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "model": {"type": ["string", "null"], "description": "Any name: the server serves one model"},
            "user": {"type": ["string", "null"]},
            "max_tokens": _integer(1, limits.max_total_tokens - 1),
            "temperature": _number(0.0, MAX_TEMPERATURE),
            "top_p": PROBABILITY,
            "seed": SEED,
            "n": _integer(1, MAX_CHOICES),
            "stop": stop,
            "presence_penalty": PENALTY,
            "frequency_penalty": PENALTY,
            "ignore_eos": BOOLEAN,
            "logit_bias": {"type": ["object", "null"], "maxProperties": 0, "description": "Not supported"},
            "stream": BOOLEAN,
            "stream_options": {
                "type": ["object", "null"],
                "additionalProperties": False,
                "properties": {"include_usage": BOOLEAN},
                "description": "Only with `stream: true`",
            },
            **fields,
        },
        # `stream_options` (non-empty) only when streaming
        "if": {
            "required": ["stream_options"],
            "properties": {"stream_options": {"type": "object", "minProperties": 1}},
        },
        "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
    }


def _openai_schemas(limits: Limits) -> dict[str, Any]:
    prompts = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": TEXT}
    chat = _openai_request(
        limits,
        messages={"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _ref("ChatMessage")},
        max_completion_tokens=_integer(1, limits.max_total_tokens - 1),
        logprobs=BOOLEAN,
        top_logprobs=_integer(0, limits.max_top_n_tokens),
        response_format={
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["type"],
                    "properties": {"type": {"const": "text"}},
                },
            ],
            "description": "Only text: Conveyor has no structured output",
        },
        tools={"type": ["array", "null"], "maxItems": 0, "description": "Conveyor does not support tool calls yet"},
        functions={"type": ["array", "null"], "maxItems": 0, "description": "Not supported"},
        tool_choice={"enum": ["none", None]},
        function_call={"enum": ["none", None]},
        parallel_tool_calls=BOOLEAN,
    )
    chat["required"] = ["messages"]
    # `top_logprobs` (non-zero) needs `logprobs: true`
    chat["allOf"] = [
        {"if": chat.pop("if"), "then": chat.pop("then")},
        {
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        },
    ]
    completion = _openai_request(
        limits,
        prompt={"oneOf": [TEXT, prompts], "description": f"Prompts times `n` at most {MAX_CHOICES}"},
        logprobs=_integer(0, limits.max_top_n_tokens),
        echo={"enum": [False, None], "description": "Not supported"},
        suffix={"type": "null", "description": "Not supported"},
        best_of={"enum": [1, None], "description": "Only 1"},
    )
    completion["required"] = ["prompt"]
    logprob = {"type": "number"}
    finish = {"enum": ["stop", "length", None]}
    entry = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {"token": {"type": "string"}, "logprob": logprob, "bytes": {"type": "array"}},
    }
    chat_logprobs = {
        "type": ["object", "null"],
        "required": ["content"],
        "properties": {
            "content": {
                "type": "array",
                "items": {
                    **entry,
                    "properties": {**entry["properties"], "top_logprobs": {"type": "array", "items": entry}},
                },
            }
        },
    }
    completion_logprobs = {
        "type": ["object", "null"],
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": logprob},
            "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": logprob}},
            "text_offset": {"type": "array", "items": {"type": "integer"}},
        },
    }

    def envelope(object_name: str, choice: dict, usage: bool) -> dict:
        schema = {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", *(["usage"] if usage else [])],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": object_name},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": choice},
                "usage": _ref("Usage"),
            },
        }
        return schema

    def choice(**fields: dict) -> dict:
        return {
            "type": "object",
            "required": ["index", *fields, "finish_reason"],
            "properties": {"index": {"type": "integer", "minimum": 0}, **fields, "finish_reason": finish},
        }

    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
    }
    delta = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    return {
        "OpenAIError": {
            "type": "object",
            "required": ["error", "error_type"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
                },
                "error_type": {"type": "string"},
            },
        },
        "CompletionRequest": completion,
        "ChatMessage": {
            "type": "object",
            "additionalProperties": False,
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "user", "assistant"]},
                "content": {"type": "string"},
                "name": {"type": ["string", "null"]},
            },
        },
        "ChatRequest": chat,
        "Usage": {
            "type": "object",
            "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        },
        "Completion": envelope(
            "text_completion", choice(text={"type": "string"}, logprobs=completion_logprobs), usage=True
        ),
        "CompletionChunk": envelope(
            "text_completion", choice(text={"type": "string"}, logprobs=completion_logprobs), usage=False
        ),
        "ChatCompletion": envelope("chat.completion", choice(message=message, logprobs=chat_logprobs), usage=True),
        "ChatCompletionChunk": envelope(
            "chat.completion.chunk", choice(delta=delta, logprobs=chat_logprobs), usage=False
        ),
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


def _post(summary: str, request: str, ok: dict, openai: bool = False) -> dict:
    body = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    return {"post": {"summary": summary, "requestBody": body, "responses": {"200": ok, **_errors(openai)}}}


def _get(summary: str, ok: dict, **extra: dict) -> dict:
    return {"get": {"summary": summary, "responses": {"200": ok, **extra}}}


def _either(description: str, json_schema: dict, sse_schema: dict) -> dict:
    """A JSON answer, or server-sent events when the request's `stream` is true."""
    return {
        "description": description,
        "content": {"application/json": {"schema": json_schema}, "text/event-stream": {"schema": sse_schema}},
    }


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
            "description": "LLM text generation with continuous batching: TGI's API and OpenAI's. Request bodies "
            "are JSON (Content-Type application/json, or none). The schemas are the server's rules, except the "
            "token limits: a prompt of more tokens than max_input_tokens, or inputs + new tokens beyond "
            "max_total_tokens, is a 422. An integer is a JSON integer: 5.0 is refused where one is expected.",
        },
        "paths": {
            "/": _post("TGI compatibility route (stream picks the shape)", "GenerateRequest", compat),
            "/generate": _post("Generate text", "GenerateRequest", _json(_ref("GenerateResponse"))),
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
        "components": {"schemas": {**_tgi_schemas(limits), **_openai_schemas(limits)}},
    }
