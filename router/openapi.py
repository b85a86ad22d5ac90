"""The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json`.

Written by hand next to the routes it describes, and as strict as the server: a request the document allows is
served, except where a rule cannot be written in JSON Schema, and one it forbids is refused with a 4xx. The rules
JSON Schema cannot state: the prompt's length in tokens, `inputs` tokens + `max_new_tokens` within
`max_total_tokens`, prompts times `n` within 8, a chat template that cannot render the messages; a structured-output
constraint that does not compile (a JSON schema llguidance cannot take, a regex or Lark grammar with an error, a
schema given as JSON text that is not a JSON object); a tool call's `arguments` that are not JSON text; two tools of
one name, or a `tool_choice` that names none of them; `max_tokens` and `max_completion_tokens` that differ; and, on
the chat route only, at most one constraint per request (stated in words: see `ChatRequest`). The limits that
depend on the deployment (stop sequences, alternatives per token, `truncate`) are the server's own.
`tests/test_openapi.py` checks that it validates, that it lists exactly the routes the app serves, and that real
responses match its schemas; `tests/faults/test_fuzz_api.py` runs schemathesis against it.

Server-sent events follow the convention of Open API 3.2 (and of Speakeasy and Stainless before it): the schema
of a `text/event-stream` response describes one event, `{"data": ...}`, whose `data` is JSON
(`contentMediaType` and `contentSchema`).
"""

from __future__ import annotations

from typing import Any

from conveyor.router.openai import MAX_CHOICES, MAX_MESSAGES, MAX_TEMPERATURE
from conveyor.router.structured import STRUCTURED_OUTPUTS_KEYS, VLLM_FIELDS
from conveyor.router.validation import (
    MAX_REPETITION_PENALTY,
    SEED_LIMIT,
    UINT32_MAX,
    Limits,
)
from conveyor.router.validation import (
    MAX_TEMPERATURE as MAX_TGI_TEMPERATURE,
)

from conveyor.grammar import MAX_CONSTRAINT_BYTES

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
NULL = {"type": "null"}

# The values of the structured-output constraints, whichever field carries them. Whether one compiles (a schema
# llguidance takes, a regex or a Lark grammar without errors) is the server's check: a 422 when it does not.
SIZE = f"At most {MAX_CONSTRAINT_BYTES // 1024} KiB."
SCHEMA_OR_TEXT = {
    "type": ["object", "string"],
    "description": "A JSON Schema, or its JSON text (which must be a JSON object). Objects get only the properties "
    "they list unless `additionalProperties` says otherwise; the output is JSON with Python's separators "
    "(`, ` and `: `). " + SIZE,
}
REGEX = {"type": "string", "minLength": 1, "description": "A regex (Rust `regex` syntax) the whole output matches"}
CHOICES = {
    "type": "array",
    "minItems": 1,
    "items": TEXT,
    "description": "The output is exactly one of these strings",
}
LARK = {"type": "string", "pattern": "\\S", "description": "A Lark grammar (llguidance's dialect), rule `start`"}


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


def _tgi_grammar() -> dict:
    """TGI's `parameters.grammar`, with the kinds Conveyor adds (json_object, choice, grammar)."""

    def kind(name: str, value: dict, required: bool = True) -> dict:
        return {
            "type": "object",
            "additionalProperties": False,
            "required": ["type", "value"] if required else ["type"],
            "properties": {"type": {"const": name}, "value": value},
        }

    return {
        "oneOf": [
            {"type": "null"},
            kind("json", SCHEMA_OR_TEXT),
            kind("regex", REGEX),
            kind("json_object", {"enum": [True, None]}, required=False),
            kind("choice", CHOICES),
            kind("grammar", LARK),
        ],
        "description": "Structured output: the text matches a JSON schema, any JSON object, a regex, one of a few "
        "strings, or a Lark grammar",
    }


def _at_most_one(unset: dict[str, dict], what: str) -> dict:
    """A schema that holds when all but at most one of the properties in `unset` are absent or match their
    schema there (what makes a property count as not given). Spelled as one branch per property that may be
    given, not as `not` over pairs, which generators cannot draw from."""
    branches = [{"properties": dict(unset)}]
    branches += [{"properties": {other: u for other, u in unset.items() if other != name}} for name in unset]
    return {"anyOf": branches, "description": what}


# What each key of vLLM's `structured_outputs` is when it asks for nothing.
STRUCTURED_UNSET = {name: NULL for name in STRUCTURED_OUTPUTS_KEYS} | {"json_object": {"enum": [False, None]}}


def _structured_outputs() -> dict:
    values = {"json": SCHEMA_OR_TEXT, "regex": REGEX, "choice": CHOICES, "grammar": LARK, "json_object": BOOLEAN}
    assert tuple(values) == STRUCTURED_OUTPUTS_KEYS
    return {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {name: _nullable(schema) if "type" in schema else schema for name, schema in values.items()},
        "allOf": [_at_most_one(STRUCTURED_UNSET, "One constraint at most (json_object: false is none)")],
        "description": "vLLM's structured output: one of json (a schema), regex, choice, grammar (Lark) or "
        "json_object (true)",
    }


def _response_format() -> dict:
    def kind(name: str, **fields: dict) -> dict:
        return {
            "type": "object",
            "additionalProperties": False,
            "required": ["type", *fields],
            "properties": {"type": {"const": name}, **fields},
        }

    json_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string"},
            "description": {"type": "string"},
            "schema": {**SCHEMA_OR_TEXT, "description": "The schema (default: any JSON object). " + SIZE},
            "strict": BOOLEAN,
        },
    }
    return {
        "oneOf": [{"type": "null"}, kind("text"), kind("json_object"), kind("json_schema", json_schema=json_schema)],
        "description": "OpenAI's structured output: text (none), any JSON object, or JSON matching a schema "
        "(always enforced, `strict` or not)",
    }


# The fields of an OpenAI request that may carry a constraint, each with what its value is when it carries none
# (within what the field accepts; an absent field carries none either).
CONSTRAINT_UNSET = {
    "response_format": {"anyOf": [NULL, {"properties": {"type": {"const": "text"}}}]},
    "structured_outputs": {"anyOf": [NULL, {"properties": STRUCTURED_UNSET}]},
    **{name: NULL for name in VLLM_FIELDS},
}


TOOLS_GIVEN = {"type": "array", "minItems": 1}


def _constraint_fields() -> dict[str, dict]:
    """The structured-output fields both OpenAI routes take; at most one may carry a constraint."""
    return {
        "response_format": _response_format(),
        "structured_outputs": _structured_outputs(),
        "guided_json": {
            **_nullable(SCHEMA_OR_TEXT),
            "description": "vLLM's older name: " + SCHEMA_OR_TEXT["description"],
        },
        "guided_regex": {**_nullable(REGEX), "description": "vLLM's older name: " + REGEX["description"]},
        "guided_choice": {**_nullable(CHOICES), "description": "vLLM's older name: " + CHOICES["description"]},
        "guided_grammar": {**_nullable(LARK), "description": "vLLM's older name: " + LARK["description"]},
    }


def _tools() -> dict[str, dict]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request."""
    function = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
            "description": {"type": "string"},
            "parameters": {
                "type": ["object", "null"],
                "description": "The JSON Schema of the arguments (default: any JSON object)",
            },
            "strict": BOOLEAN,
        },
    }
    tool = {
        "type": "object",
        "additionalProperties": False,
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function},
    }
    named = {
        "type": "object",
        "additionalProperties": False,
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {"name": {"type": "string", "description": "One of `tools`"}},
            },
        },
    }
    return {
        "tools": {
            "type": ["array", "null"],
            "items": tool,
            "description": "Functions the model may call, shown to it by the chat template; names are unique",
        },
        "tool_choice": {
            "oneOf": [{"enum": ["none", "auto", "required", None]}, named],
            "description": "none: no tools; auto (the default with tools): calls written as "
            '`<tool_call>{"name": ..., "arguments": ...}</tool_call>` are read from the output; required: at '
            "least one call, forced by a grammar; a named function: a call to it, its arguments forced",
        },
        "parallel_tool_calls": {**BOOLEAN, "description": "With `required`: false allows one call only"},
        "functions": {"type": ["array", "null"], "maxItems": 0, "description": "Not supported: use `tools`"},
        "function_call": {"enum": ["none", None], "description": "Not supported: use `tool_choice`"},
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
                "grammar": _tgi_grammar(),
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
                "generation_defaults": {
                    "type": "object",
                    "description": "The model's generation_config.json sampling, for parameters a request leaves unset",
                },
                "weight_bytes": {"type": "integer", "description": "Rank 0's weights in memory, as loaded"},
                "quantize": {"type": ["string", "null"], "description": "Weight quantization (--quantize), or null"},
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
            **_constraint_fields(),
            **fields,
        },
        "allOf": [
            {  # `stream_options` (non-empty) only when streaming
                "anyOf": [
                    {"properties": {"stream_options": {"anyOf": [NULL, {"maxProperties": 0}]}}},
                    {"required": ["stream"], "properties": {"stream": {"const": True}}},
                ]
            },
        ],
    }


def _chat_message() -> dict:
    """A message: system, user, assistant or tool. An assistant's may carry `tool_calls` instead of content (as
    OpenAI returns them: arguments as JSON text); a tool's answers one of those calls by its id."""
    call = {
        "type": "object",
        "required": ["function"],
        "properties": {
            "id": {"description": "The call's id, as the response gave it"},
            "type": {"description": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"description": "JSON text, as OpenAI sends it (or the arguments themselves)"},
                },
            },
        },
    }
    calls = {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant", "tool"]},
            "content": {"type": ["string", "null"], "description": "Required (a string) unless tool calls"},
            "name": {"type": ["string", "null"]},
            "tool_calls": {"type": ["array", "null"], "items": call, "description": "Only on assistant messages"},
            "tool_call_id": {"type": ["string", "null"], "description": "Required on tool messages"},
        },
        "allOf": [
            {  # an assistant's calls stand instead of content; any other message has string content
                "if": calls,
                "then": {"properties": {"role": {"const": "assistant"}}},
                "else": {"required": ["content"], "properties": {"content": {"type": "string"}}},
            },
            {
                "if": {"properties": {"role": {"const": "tool"}}},
                "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
            },
        ],
    }


def _openai_schemas(limits: Limits) -> dict[str, Any]:
    prompts = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": TEXT}
    chat = _openai_request(
        limits,
        messages={"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _ref("ChatMessage")},
        max_completion_tokens={
            **_integer(1, limits.max_total_tokens - 1),
            "description": "OpenAI's newer name for `max_tokens`; given both, their values must be equal (else 422)",
        },
        logprobs=BOOLEAN,
        top_logprobs=_integer(0, limits.max_top_n_tokens),
        **_tools(),
    )
    chat["required"] = ["messages"]
    chat["description"] = (
        "At most one structured-output constraint (a `response_format` other than text, `structured_outputs`, a "
        "`guided_*` field) per request, else 422. The completions route states that rule in JSON Schema; here it "
        "is stated in words only, as together with the tool rules it makes a schema that schema-based request "
        "generators (schemathesis) cannot draw from"
    )
    chat["allOf"] += [
        {  # `top_logprobs` (non-zero) needs `logprobs: true`
            "anyOf": [
                {"properties": {"top_logprobs": {"anyOf": [NULL, {"maximum": 0}]}}},
                {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
            ]
        },
        {  # a `tool_choice` other than none needs tools; a forced call (required or named) is itself a constraint
            "anyOf": [
                {"properties": {"tool_choice": {"enum": ["none", None]}}},
                {"required": ["tools"], "properties": {"tools": TOOLS_GIVEN, "tool_choice": {"const": "auto"}}},
                {"required": ["tools"], "properties": {"tools": TOOLS_GIVEN, **CONSTRAINT_UNSET}},
            ]
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
    completion["allOf"].append(_at_most_one(CONSTRAINT_UNSET, "One structured-output constraint per request at most"))
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

    def choice(finish: dict = finish, **fields: dict) -> dict:
        return {
            "type": "object",
            "required": ["index", *fields, "finish_reason"],
            "properties": {"index": {"type": "integer", "minimum": 0}, **fields, "finish_reason": finish},
        }

    chat_finish = {
        "enum": ["stop", "length", "tool_calls", None],
        "description": "tool_calls: the choice ended with tool calls",
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"], "description": "null when the answer is tool calls only"},
            "tool_calls": {"type": "array", "minItems": 1, "items": _ref("ToolCall")},
        },
    }
    call_delta = {
        "type": "object",
        "required": ["index"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "id": {"type": "string", "pattern": "^call_"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
        "description": "A call's first delta has its id, type and name; later ones add to its arguments",
    }
    delta = {
        "type": "object",
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": "string"},
            "tool_calls": {"type": "array", "minItems": 1, "items": call_delta},
        },
    }
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
        "ChatMessage": _chat_message(),
        "ToolCall": {
            "type": "object",
            "required": ["id", "type", "function"],
            "properties": {
                "id": {"type": "string", "pattern": "^call_"},
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name", "arguments"],
                    "properties": {
                        "name": {"type": "string"},
                        "arguments": {"type": "string", "description": "JSON text"},
                    },
                },
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
        "ChatCompletion": envelope(
            "chat.completion", choice(chat_finish, message=message, logprobs=chat_logprobs), usage=True
        ),
        "ChatCompletionChunk": envelope(
            "chat.completion.chunk", choice(chat_finish, delta=delta, logprobs=chat_logprobs), usage=False
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
