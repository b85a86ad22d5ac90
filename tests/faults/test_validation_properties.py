"""Property tests (hypothesis) for the router's validation and the sampling parameters it hands the shards.

- Any bytes as a body, and any JSON value in any field of TGI's and OpenAI's requests, give a valid request or a
  `ValidationError`, never another exception (which the HTTP layer would turn into a 500).
- What validation accepts is within its limits: token budget, ranges, types.
- Every sampling configuration validation accepts, sent the way the scheduler sends it (float32 protobuf) and
  read the way the shard reads it, samples a real token with a finite log-probability; and a temperature or
  top-p too small for float32 still means "the most likely token", not "unset".

CI runs a fixed, derandomized set of examples; CONVEYOR_FUZZ_EXAMPLES=N runs N fresh random ones per property.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from conveyor.router.api.base import parse
from conveyor.router.api.constraints import ConstraintFields
from conveyor.router.api.openai import ChatRequest, CompletionRequest, Message
from conveyor.router.api.tgi import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_POSITIVE,
    WARPERS,
    GenerateParameters,
)
from conveyor.router.limits import Limits
from conveyor.router.pipeline.openai_requests import Choice, OpenAIRequests
from conveyor.router.pipeline.request import ValidRequest, tgi_request
from conveyor.router.pipeline.validation import Validation, ValidationError
from conveyor.router.transport.wire import sampling_pb
from conveyor.shard.sampling.sampler import Sampler, SamplingParams

EXAMPLES = int(os.environ.get("CONVEYOR_FUZZ_EXAMPLES", "0"))
LIMITS = Limits(max_input_tokens=32, max_total_tokens=64, max_stop_sequences=3, max_top_n_tokens=4)
VOCAB = 64


def examples(default: int) -> settings:
    return settings(
        max_examples=EXAMPLES or default,
        deadline=None,
        derandomize=not EXAMPLES,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# --- strategies -----------------------------------------------------------------------------------------------

# Text with everything JSON can carry, lone surrogates included (json.loads accepts "\ud800").
TEXT = st.text(st.characters(exclude_categories=()), max_size=24)
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-3.0, max_value=3.0),
    st.sampled_from([0, 1, 2**32, 2**64, 1e-50, 1e-320, 1e308, -0.0, 0.5, 101.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(TEXT, inner, max_size=5)),
    max_leaves=12,
)


EXTREMES = [1e-300, 1e-50, 1e-45, 1e-40, 1e-7, 1e-6]
POSITIVE = st.one_of(st.floats(min_value=1e-300, max_value=100.0), st.sampled_from(EXTREMES))
FRACTION = st.one_of(st.floats(min_value=1e-300, max_value=1.0), st.sampled_from(EXTREMES))
PENALTY = st.floats(min_value=-2.0, max_value=2.0)
STOP = st.text(min_size=1, max_size=4)


def often(likely: st.SearchStrategy, rarely: st.SearchStrategy, odds: int = 4) -> st.SearchStrategy:
    """`likely`, and one time in `odds + 1` `rarely`."""
    return st.integers(0, odds).flatmap(lambda n: rarely if n == 0 else likely)


# Structured output: bounded schemas, regexes, choices and Lark grammars (a few that do not compile), so that
# most requests that carry one pass and the compile step runs.
SCHEMAS = st.sampled_from(
    [
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]},
        {"enum": ["a", "b"]},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        {"type": "object"},
        {},
        {"type": "nope"},
        {"type": "string", "minLength": 3, "maxLength": 1},
        {"$ref": "#/$defs/missing"},
    ]
)
SCHEMA_VALUES = often(SCHEMAS, st.one_of(SCHEMAS.map(json.dumps), TEXT, JSON_VALUES))
REGEXES = often(st.sampled_from(["[0-9]{1,3}", "(yes|no)", "a+b?", "\\w{2}", "(", "a{2,1}"]), TEXT)
CHOICES = often(st.lists(STOP, min_size=1, max_size=3), JSON_VALUES)
GRAMMARS = often(st.sampled_from(['start: "a" | "b"', 'start: x x\nx: "ab" | "c"', "start: nowhere", "x"]), TEXT)
TGI_GRAMMARS = st.one_of(
    st.fixed_dictionaries({"type": st.just("json"), "value": SCHEMA_VALUES}),
    st.fixed_dictionaries({"type": st.just("regex"), "value": REGEXES}),
    st.fixed_dictionaries({"type": st.just("choice"), "value": CHOICES}),
    st.fixed_dictionaries({"type": st.just("grammar"), "value": GRAMMARS}),
    st.fixed_dictionaries({"type": st.just("json_object")}, optional={"value": st.sampled_from([True, None, 1])}),
)
RESPONSE_FORMATS = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {},
                optional={
                    "name": st.text(max_size=8),
                    "schema": SCHEMA_VALUES,
                    "strict": st.booleans(),
                    "description": TEXT,
                },
            ),
        }
    ),
)
_STRUCTURED_KINDS = {
    "json": SCHEMA_VALUES,
    "regex": REGEXES,
    "choice": CHOICES,
    "grammar": GRAMMARS,
    "json_object": st.sampled_from([True, False, None, 0, 1]),
}
# One kind, and now and then several (refused) or none
STRUCTURED_OUTPUTS = often(
    st.one_of(st.fixed_dictionaries({kind: values}) for kind, values in _STRUCTURED_KINDS.items()),
    st.fixed_dictionaries({}, optional=_STRUCTURED_KINDS),
)
# Mostly null (no constraint), so that a body seldom carries two, which is refused.
CONSTRAINTS = {
    name: often(st.none(), values, 3)
    for name, values in {
        "response_format": RESPONSE_FORMATS,
        "structured_outputs": STRUCTURED_OUTPUTS,
        "guided_json": SCHEMA_VALUES,
        "guided_regex": REGEXES,
        "guided_choice": CHOICES,
        "guided_grammar": GRAMMARS,
    }.items()
}
TOOL_NAMES = often(st.sampled_from(["get_weather", "f", "f.g-1"]), st.sampled_from(["bad name", "f\n", ""]), 8)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": TOOL_NAMES}, optional={"parameters": SCHEMAS, "description": TEXT, "strict": st.booleans()}
        ),
    }
)
# Mostly of distinct names (two of one name are refused)
TOOLS = often(st.lists(TOOL, max_size=3, unique_by=lambda t: t["function"]["name"]), st.lists(TOOL, max_size=3))
TOOL_CHOICES = st.one_of(
    st.sampled_from(["none", "auto", "required"]),
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": TOOL_NAMES})}),
)
TOOL_CALLS = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.just("call_1"),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": TOOL_NAMES, "arguments": often(st.sampled_from(['{"n": 1}', "{}", "[1]"]), JSON_VALUES)}
            ),
        }
    ),
    min_size=1,
    max_size=2,
)

# Values each field accepts (some at the edges of its range), so that a good share of the requests pass.
# The sampling fields TGI's and OpenAI's routes share (`SharedSampling`).
SHARED_VALID = {
    "top_k": st.integers(0, 2**32 - 1),
    "top_p": FRACTION,
    "typical_p": FRACTION,
    "min_p": st.one_of(st.floats(min_value=0.0, max_value=1.0), st.sampled_from([0.0, 1e-50, 1.0])),
    "seed": st.integers(0, 2**64 - 1),
    "repetition_penalty": POSITIVE,
    "frequency_penalty": PENALTY,
    "presence_penalty": PENALTY,
    # Not sampling, but on both APIs alike (`Serving`).
    "priority": st.integers(-(2**31), 2**31 - 1),
    "cache_salt": st.text(min_size=1, max_size=256),
    "speculate": st.integers(0, 16),
}
TGI_VALID = {
    **SHARED_VALID,
    "temperature": POSITIVE,
    "do_sample": st.booleans(),
    "max_new_tokens": st.integers(1, 40),
    "stop": st.lists(STOP, max_size=3),
    "ignore_eos": st.booleans(),
    "details": st.booleans(),
    "decoder_input_details": st.booleans(),
    "return_full_text": st.booleans(),
    "top_n_tokens": st.integers(0, 4),
    "truncate": st.integers(1, 32),
    "best_of": st.just(1),
    "watermark": st.just(False),
    "grammar": TGI_GRAMMARS,
    "adapter_id": st.none(),
}
OPENAI_VALID = {
    **SHARED_VALID,
    "model": st.text(max_size=8),
    "user": st.text(max_size=8),
    "max_tokens": st.integers(1, 30),
    "temperature": st.one_of(st.floats(min_value=0.0, max_value=2.0), st.just(0)),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.one_of(STOP, st.lists(STOP, max_size=3)),
    "logit_bias": st.just({}),
    "ignore_eos": st.booleans(),
    **CONSTRAINTS,
}
COMPLETION_VALID = {
    **OPENAI_VALID,
    "logprobs": st.integers(0, 4),
    "echo": st.just(False),
    "suffix": st.none(),
    "best_of": st.just(1),
}
CHAT_VALID = {
    **OPENAI_VALID,
    "max_completion_tokens": st.integers(1, 30),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 4),
    "tools": TOOLS,
    "functions": st.just([]),
    "tool_choice": TOOL_CHOICES,
    "function_call": st.just("none"),
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "x", "tools", "bos_token", "add_generation_prompt"]),
        JSON_VALUES,
        max_size=2,
    ),
}


def _fields(valid: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict[str, Any]]:
    """Some of the known fields, each mostly with a value it accepts, sometimes null or any JSON value; and
    now and then a field nobody knows."""
    known = st.fixed_dictionaries(
        {}, optional={name: often(values, st.one_of(st.none(), JSON_VALUES), 15) for name, values in valid.items()}
    )
    unknown = st.dictionaries(TEXT, JSON_VALUES, max_size=2)
    return often(known, st.builds(lambda a, b: {**b, **a}, known, unknown))


VALID_PROMPTS = st.sampled_from(["hello world", "def f():", "x", "é ü 𝄞"])
PROMPTS = often(VALID_PROMPTS, st.one_of(st.sampled_from(["", "\ud800", "x " * 100]), TEXT, JSON_VALUES), 8)
TGI_BODIES = often(
    st.fixed_dictionaries(
        {"inputs": PROMPTS, "parameters": often(_fields(TGI_VALID), st.one_of(st.none(), JSON_VALUES))},
        optional={"stream": often(st.booleans(), JSON_VALUES)},
    ),
    JSON_VALUES,
)
# A message's fields, each with what it takes (the fuzz below also sends them with any JSON value).
_MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
MESSAGES = st.lists(
    often(
        st.one_of(
            st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": PROMPTS}),
            st.fixed_dictionaries(
                {"role": st.just("assistant"), "tool_calls": TOOL_CALLS},
                optional={"content": st.one_of(st.none(), PROMPTS)},
            ),
            st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": PROMPTS}),
        ),
        st.one_of(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "tool", "robot", ""]), "content": PROMPTS},
                optional={
                    "name": st.one_of(TEXT, JSON_VALUES),
                    "tool_calls": JSON_VALUES,
                    "tool_call_id": JSON_VALUES,
                    "reasoning_content": st.one_of(TEXT, JSON_VALUES),
                    "x": JSON_VALUES,
                },
            ),
            JSON_VALUES,
        ),
        8,
    ),
    min_size=1,
    max_size=4,
)
COMPLETION_BODIES = st.builds(
    lambda fields, prompt: {**fields, "prompt": prompt},
    _fields(COMPLETION_VALID),
    st.one_of(PROMPTS, st.lists(PROMPTS, max_size=3)),
)
CHAT_BODIES = st.builds(
    lambda fields, messages: {**fields, "messages": messages},
    _fields(CHAT_VALID),
    often(MESSAGES, JSON_VALUES),
)


@pytest.fixture(scope="module")
def validation(tiny_model: Path) -> Validation:
    from transformers import AutoTokenizer

    return Validation(AutoTokenizer.from_pretrained(tiny_model), LIMITS)


# --- properties -------------------------------------------------------------------------------------------------


def _names(model: type[BaseModel]) -> set[str]:
    """A model's fields as a body names them."""
    return {info.alias or name for name, info in model.model_fields.items()}


def test_every_field_is_fuzzed() -> None:
    assert set(TGI_VALID) == _names(GenerateParameters)
    assert set(COMPLETION_VALID) == _names(CompletionRequest) - {"prompt"}
    assert set(CHAT_VALID) == _names(ChatRequest) - {"messages"}
    assert set(_MESSAGE_FIELDS) == _names(Message)


def check_valid(valid: ValidRequest) -> None:
    """What any request that passed validation satisfies."""
    p, s = valid.parameters, valid.parameters.sampling
    assert valid.inputs and 1 <= len(valid.input_ids) <= LIMITS.max_input_tokens
    assert p.max_new_tokens >= 1 and len(valid.input_ids) + p.max_new_tokens <= LIMITS.max_total_tokens
    assert MIN_POSITIVE <= s.temperature <= MAX_TEMPERATURE
    assert MIN_POSITIVE <= s.repetition_penalty <= MAX_REPETITION_PENALTY
    assert MIN_POSITIVE <= s.top_p <= 1.0 and MIN_POSITIVE <= s.typical_p <= 1.0 and 0.0 <= s.min_p <= 1.0
    assert -2.0 <= s.frequency_penalty <= 2.0 and -2.0 <= s.presence_penalty <= 2.0
    assert 0 <= s.top_k < 2**32 and 0 <= p.top_n_tokens <= LIMITS.max_top_n_tokens
    assert len(p.stop) <= LIMITS.max_stop_sequences and all(isinstance(x, str) and x for x in p.stop)
    assert (p.seed is not None or not s.samples) and (p.seed is None or 0 <= p.seed < 2**64)
    assert all(isinstance(x, bool) for x in (s.do_sample, p.details, p.ignore_eos, p.return_full_text))
    for text in (valid.inputs, *p.stop):
        text.encode("utf-8")  # no lone surrogate reaches the tokenizer or protobuf
    sampling_pb(p)  # every value fits its protobuf field


@examples(300)
@given(body=TGI_BODIES, stream=st.booleans())
def test_any_tgi_body_is_valid_or_a_validation_error(validation: Validation, body: Any, stream: bool) -> None:
    try:
        valid = validation.validate(tgi_request(body, stream=stream))
    except ValidationError as exc:
        assert str(exc)
        event("refused")
        return
    event("accepted")
    check_valid(valid)


@examples(300)
@given(
    raw=st.one_of(
        st.binary(max_size=200),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.builds(
            lambda depth, tail: b"[" * depth + tail + b"]" * depth,
            st.integers(0, 5000),
            st.sampled_from([b"", b"1", b"{"]),
        ),
        st.builds(lambda digits: b'{"a": ' + b"9" * digits + b"}", st.integers(1, 10_000)),
    )
)
def test_any_bytes_are_a_request_or_a_validation_error(validation: Validation, raw: bytes) -> None:
    try:
        validation.validate(tgi_request(raw, stream=False))
    except ValidationError as exc:
        assert str(exc)


def accepted(choices_of, model: type, body: dict, stream: bool) -> list[Choice] | None:
    """An OpenAI body parses into 1 to 8 valid requests, or is refused with a ValidationError; the choices if
    accepted. A constraint the body asks for is never accepted and ignored."""
    try:
        choices = choices_of(parse(model, {"stream": stream, **body}))
    except ValidationError as exc:
        assert str(exc)
        event("refused")
        return None
    event("accepted")
    assert 1 <= len(choices) <= 8
    for choice in choices:
        check_valid(choice.request)
        assert (choice.request.parameters.grammar is not None) == _asks_for_a_constraint(body)
        sampling = choice.request.parameters.sampling
        if body.get("temperature") == 0:  # greedy: every warper dropped, none turns sampling back on
            assert not sampling.samples and all(getattr(sampling, name) == WARPERS[name] for name in WARPERS)
        else:  # unset or positive: sampled, as OpenAI and vLLM do
            assert sampling.samples
    return choices


GUIDED_FIELDS = [name for name in ConstraintFields.model_fields if name.startswith("guided_")]


def _asks_for_a_constraint(body: dict) -> bool:
    """Whether an accepted body carries a structured-output constraint, or a tool choice that forces one."""
    given = [
        (body.get("response_format") or {}).get("type") in ("json_object", "json_schema"),
        any(v is not None and v is not False for v in (body.get("structured_outputs") or {}).values()),
        *(body.get(name) is not None for name in GUIDED_FIELDS),
        bool(body.get("tools"))
        and (body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict)),
    ]
    return any(given)


@examples(200)
@given(body=COMPLETION_BODIES, stream=st.booleans())
def test_any_completion_body_is_valid_or_a_validation_error(validation: Validation, body: dict, stream: bool) -> None:
    requests = OpenAIRequests(validation)  # parsing only: no queue, no shards
    accepted(requests.completion_choices, CompletionRequest, body, stream)


@examples(200)
@given(body=CHAT_BODIES, stream=st.booleans())
def test_any_chat_body_is_valid_or_a_validation_error(validation: Validation, body: dict, stream: bool) -> None:
    requests = OpenAIRequests(validation)
    choices = accepted(requests.chat_choices, ChatRequest, body, stream)
    if choices is not None:
        for name in ("functions", "logit_bias"):
            assert body.get(name) in (None, [], {})  # never accepted and ignored
        # tools reach the model unless there are none or `tool_choice` is none
        offered = bool(body.get("tools")) and body.get("tool_choice") != "none"
        assert all((c.output.tools is not None) == offered for c in choices)
        if offered:
            event(f"tool_choice {choices[0].output.tools.choice}")


# --- sampling -------------------------------------------------------------------------------------------------

SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.one_of(st.floats(min_value=0, max_value=200), st.sampled_from([*EXTREMES, 100.0, 1e308])),
        "top_k": st.integers(0, 100),
        "top_p": st.one_of(st.floats(min_value=0, max_value=1), st.sampled_from(EXTREMES)),
        "typical_p": st.one_of(st.floats(min_value=0, max_value=1), st.sampled_from(EXTREMES)),
        "min_p": st.one_of(st.floats(min_value=0, max_value=1), st.sampled_from([*EXTREMES, 1.0])),
        "repetition_penalty": st.one_of(st.floats(min_value=0, max_value=200), st.sampled_from(EXTREMES)),
        "frequency_penalty": st.floats(min_value=-2, max_value=2),
        "presence_penalty": st.floats(min_value=-2, max_value=2),
        "do_sample": st.booleans(),
        "seed": st.integers(0, 2**64 - 1),
    },
)


def _shard_side(valid: ValidRequest) -> SamplingParams:
    """The parameters as the shard reads them: through the scheduler's protobuf message, float32 and all."""
    wire = type(sampling_pb(valid.parameters)).FromString(sampling_pb(valid.parameters).SerializeToString())
    return SamplingParams.from_pb(wire)


@examples(150)
@given(parameters=SAMPLING, logits_seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 3.0, 30.0, 1e4]))
def test_every_accepted_sampling_configuration_samples_a_real_token(
    validation: Validation, parameters: dict, logits_seed: int, scale: float
) -> None:
    try:
        valid = validation.validate(tgi_request({"inputs": "def f():", "parameters": parameters}, stream=False))
    except ValidationError:
        return
    params = _shard_side(valid)
    assert all(
        math.isfinite(x) for x in (params.temperature, params.top_p, params.typical_p, params.repetition_penalty)
    )
    assert params.sampling == valid.parameters.sampling.samples
    generator = torch.Generator().manual_seed(logits_seed)
    logits = torch.randn((1, VOCAB), generator=generator) * scale
    sampler = Sampler.build([params], [[1, 2, 3, 2]], VOCAB, torch.device("cpu"), generated_ids=[[2]])
    for _ in range(3):
        sample = sampler(logits)
        assert 0 <= int(sample.ids) < VOCAB
        assert math.isfinite(float(sample.logprobs))
        assert not sample.distribution.isnan().any()


@examples(100)
@given(
    tiny=st.sampled_from([*EXTREMES, 1e-5]),
    which=st.sampled_from(["temperature", "top_p", "both"]),
    seed=st.integers(0, 2**63),
    logits_seed=st.integers(0, 2**16),
)
def test_a_vanishing_temperature_or_top_p_picks_the_most_likely_token(
    validation: Validation, tiny: float, which: str, seed: int, logits_seed: int
) -> None:
    """Below ~1e-45 a float32 is 0, and 0 in the protobuf means "unset": 1e-50 used to sample at temperature 1."""
    chosen = {"temperature": tiny} if which == "temperature" else {"top_p": tiny}
    if which == "both":
        chosen = {"temperature": tiny, "top_p": tiny}
    valid = validation.validate(tgi_request({"inputs": "x", "parameters": {**chosen, "seed": seed}}, stream=False))
    params = _shard_side(valid)
    generator = torch.Generator().manual_seed(logits_seed)
    logits = torch.randn((1, VOCAB), generator=generator) * 3
    top2 = logits.topk(2).values[0]
    if float(top2[0] - top2[1]) < 1e-3:  # a near tie: either token is "the most likely"
        return
    sampler = Sampler.build([params], [[1]], VOCAB, torch.device("cpu"))
    for _ in range(5):
        assert int(sampler(logits).ids) == int(logits.argmax())
