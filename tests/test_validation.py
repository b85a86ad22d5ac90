"""Validation of untrusted `/generate` bodies: every bad value is a `ValidationError` naming what is wrong."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import transformers
from conveyor.launcher import demo_model
from conveyor.router.validation import Limits, Parameters, Validation, ValidationError, ValidRequest

LIMITS = Limits(max_input_tokens=32, max_total_tokens=64, max_stop_sequences=2, max_top_n_tokens=3)
PROMPT = "hello world"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model.ensure(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def validation(tokenizer: Any) -> Validation:
    return Validation(tokenizer, LIMITS)


def prompt_ids(tokenizer: Any, text: str = PROMPT) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)


def generate(validation: Validation, stream: bool = False, **parameters: Any) -> ValidRequest:
    return validation.validate({"inputs": PROMPT, "parameters": parameters}, stream=stream)


# --- Happy paths ----------------------------------------------------------------------------------------------


def test_defaults(validation: Validation, tokenizer: Any) -> None:
    ids = prompt_ids(tokenizer)
    valid = validation.validate({"inputs": PROMPT}, stream=False)
    assert valid.inputs == PROMPT
    assert valid.input_ids == tuple(ids)
    assert valid.input_ids[0] == 0  # the BOS the tokenizer adds
    assert valid.parameters == Parameters(max_new_tokens=LIMITS.max_total_tokens - len(ids))
    assert not valid.parameters.sampling
    assert valid.parameters.seed is None


@pytest.mark.parametrize("parameters", [None, {}])
def test_missing_or_null_parameters_mean_defaults(validation: Validation, parameters: Any) -> None:
    body = {"inputs": PROMPT} if parameters is None else {"inputs": PROMPT, "parameters": parameters}
    assert (
        validation.validate(body, stream=True).parameters
        == validation.validate({"inputs": PROMPT, "parameters": None}, stream=True).parameters
    )


def test_every_parameter_null_means_default(validation: Validation) -> None:
    """huggingface_hub sends every TGI parameter, most of them null."""
    names = TGI_PARAMETER_NAMES
    nulls = generate(validation, **dict.fromkeys(names)).parameters
    assert nulls == generate(validation).parameters


def test_all_parameters_set(validation: Validation) -> None:
    valid = generate(
        validation,
        temperature=0.5,
        top_k=10,
        top_p=0.9,
        typical_p=0.95,
        do_sample=True,
        seed=42,
        repetition_penalty=1.2,
        frequency_penalty=-0.5,
        presence_penalty=2,
        max_new_tokens=5,
        stop=["\n", "end"],
        ignore_eos=True,
        details=True,
        decoder_input_details=True,
        return_full_text=True,
        top_n_tokens=3,
        truncate=4,
        best_of=1,
        watermark=False,
    )
    assert valid.parameters == Parameters(
        temperature=0.5,
        top_k=10,
        top_p=0.9,
        typical_p=0.95,
        do_sample=True,
        seed=42,
        repetition_penalty=1.2,
        frequency_penalty=-0.5,
        presence_penalty=2.0,
        max_new_tokens=5,
        stop=("\n", "end"),
        ignore_eos=True,
        details=True,
        decoder_input_details=True,
        return_full_text=True,
        top_n_tokens=3,
        truncate=4,
    )
    assert isinstance(valid.parameters.presence_penalty, float)


def test_ints_are_accepted_as_floats(validation: Validation) -> None:
    parameters = generate(validation, temperature=2, top_p=1, repetition_penalty=3).parameters
    assert (parameters.temperature, parameters.top_p, parameters.repetition_penalty) == (2.0, 1.0, 3.0)
    assert all(isinstance(x, float) for x in (parameters.temperature, parameters.top_p))


def test_stream_key_beside_inputs_is_accepted(validation: Validation) -> None:
    assert validation.validate({"inputs": PROMPT, "stream": True}, stream=True).inputs == PROMPT


def test_truncate_keeps_the_last_tokens(validation: Validation, tokenizer: Any) -> None:
    ids = prompt_ids(tokenizer)
    valid = generate(validation, truncate=3)
    assert valid.input_ids == tuple(ids[-3:])
    assert valid.parameters.max_new_tokens == LIMITS.max_total_tokens - 3


def test_truncate_lets_a_long_prompt_through(validation: Validation, tokenizer: Any) -> None:
    text = "the quick brown fox " * 20
    assert len(prompt_ids(tokenizer, text)) > LIMITS.max_input_tokens
    valid = validation.validate({"inputs": text, "parameters": {"truncate": LIMITS.max_input_tokens}}, stream=False)
    assert valid.input_ids == tuple(prompt_ids(tokenizer, text)[-LIMITS.max_input_tokens :])


def test_default_max_new_tokens_fills_the_total(validation: Validation, tokenizer: Any) -> None:
    n = len(prompt_ids(tokenizer))
    assert generate(validation).parameters.max_new_tokens == LIMITS.max_total_tokens - n


def test_configured_default_max_new_tokens(tokenizer: Any) -> None:
    validation = Validation(tokenizer, Limits(max_input_tokens=32, max_total_tokens=64, max_new_tokens_default=7))
    assert generate(validation).parameters.max_new_tokens == 7
    assert generate(validation, max_new_tokens=20).parameters.max_new_tokens == 20


def test_configured_default_is_capped_by_the_room_left(tokenizer: Any) -> None:
    n = len(prompt_ids(tokenizer))
    limits = Limits(max_input_tokens=n, max_total_tokens=n + 3, max_new_tokens_default=100)
    assert generate(Validation(tokenizer, limits)).parameters.max_new_tokens == 3


def test_max_new_tokens_may_fill_the_total_exactly(validation: Validation, tokenizer: Any) -> None:
    n = len(prompt_ids(tokenizer))
    assert generate(validation, max_new_tokens=LIMITS.max_total_tokens - n).parameters.max_new_tokens == 64 - n


def test_prompt_at_the_input_limit_passes(tokenizer: Any) -> None:
    n = len(prompt_ids(tokenizer))
    validation = Validation(tokenizer, Limits(max_input_tokens=n, max_total_tokens=n + 1))
    assert generate(validation).parameters.max_new_tokens == 1


@pytest.mark.parametrize(
    "parameters",
    [{"do_sample": True}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.5}, {"typical_p": 0.5}],
)
def test_seed_is_filled_when_sampling(validation: Validation, parameters: dict[str, Any]) -> None:
    random.seed(1234)
    expected = random.getrandbits(63)
    random.seed(1234)
    valid = generate(validation, **parameters)
    assert valid.parameters.sampling
    assert valid.parameters.seed == expected
    assert 0 <= valid.parameters.seed < 2**63


def test_given_seed_is_kept(validation: Validation) -> None:
    assert generate(validation, do_sample=True, seed=2**64 - 1).parameters.seed == 2**64 - 1
    assert generate(validation, seed=0).parameters.seed == 0  # greedy keeps what it was given


def test_greedy_leaves_seed_unset(validation: Validation) -> None:
    valid = generate(validation, do_sample=False, temperature=1.0, top_p=1.0, repetition_penalty=1.5)
    assert not valid.parameters.sampling
    assert valid.parameters.seed is None


def test_validate_prompt_is_the_shared_core(validation: Validation) -> None:
    by_body = validation.validate({"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}, stream=False)
    assert validation.validate_prompt(PROMPT, {"max_new_tokens": 3}) == by_body
    with pytest.raises(ValidationError, match="decoder_input_details"):
        validation.validate_prompt(PROMPT, {"decoder_input_details": True}, stream=True)


# --- Rejections -------------------------------------------------------------------------------------------------

BAD_PARAMETERS = [
    # (parameters, a fragment the message must contain)
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"temperature": -1.0}, "`temperature` must be strictly positive"),
    ({"temperature": "hot"}, "`temperature` must be a number"),
    ({"temperature": True}, "`temperature` must be a number"),
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": -2.01}, "`frequency_penalty`"),
    ({"presence_penalty": 3}, "`presence_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"top_k": -3}, "`top_k` must be strictly positive"),
    ({"top_k": 2**32}, "`top_k` must be <="),
    ({"top_k": 5.0}, "`top_k` must be an integer"),
    ({"top_k": True}, "`top_k` must be an integer"),
    ({"top_p": 0}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"top_p": 1.5}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"typical_p": 0.0}, "`typical_p` must be > 0.0 and <= 1.0"),
    ({"typical_p": 1.01}, "`typical_p`"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": -1}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": "10"}, "`max_new_tokens` must be an integer"),
    ({"max_new_tokens": False}, "`max_new_tokens` must be an integer"),
    ({"seed": -1}, "`seed` must be >= 0 and < 2^64"),
    ({"seed": 2**64}, "`seed` must be >= 0 and < 2^64"),
    ({"seed": 1.5}, "`seed` must be an integer"),
    ({"seed": True}, "`seed` must be an integer"),
    ({"top_n_tokens": 4}, "`top_n_tokens` must be >= 0 and <= 3"),
    ({"top_n_tokens": -1}, "`top_n_tokens`"),
    ({"stop": "end"}, "`stop` must be a list of strings"),
    ({"stop": ["a", "b", "c"]}, "`stop` supports up to 2 stop sequences. Given: 3"),
    ({"stop": [""]}, "`stop` sequences must not be empty"),
    ({"stop": [1]}, "`stop` must be a string"),
    ({"stop": ["\ud800"]}, "`stop` must be valid Unicode"),
    ({"truncate": 0}, "`truncate` must be strictly positive and <= 32"),
    ({"truncate": 33}, "`truncate` must be strictly positive and <= 32"),
    ({"truncate": "3"}, "`truncate` must be an integer"),
    ({"do_sample": 1}, "`do_sample` must be a boolean"),
    ({"do_sample": "true"}, "`do_sample` must be a boolean"),
    ({"details": 0}, "`details` must be a boolean"),
    ({"decoder_input_details": "yes"}, "`decoder_input_details` must be a boolean"),
    ({"return_full_text": []}, "`return_full_text` must be a boolean"),
    ({"ignore_eos": 1.0}, "`ignore_eos` must be a boolean"),
    ({"best_of": 2}, "`best_of` > 1 is not supported"),
    ({"best_of": 0}, "`best_of` must be strictly positive"),
    ({"best_of": True}, "`best_of` must be an integer"),
    ({"watermark": True}, "`watermark` is not supported"),
    ({"watermark": "no"}, "`watermark` must be a boolean"),
    ({"grammar": {"type": "xml", "value": {}}}, "`grammar.type` must be one of"),
    ({"grammar": {"type": "json", "value": {"type": "nope"}}}, "invalid json schema"),
    ({"grammar": {"type": "regex", "value": "(ab"}}, "invalid regex"),
    ({"grammar": {"type": "regex", "value": ""}}, "a regex must be a non-empty string"),
    ({"adapter_id": "lora"}, "`adapter_id` is not supported"),
    ({"temprature": 0.5}, "unknown parameter `temprature`"),
    ({"max_tokens": 5}, "unknown parameter `max_tokens`"),
]


@pytest.mark.parametrize(("parameters", "message"), BAD_PARAMETERS, ids=[repr(p) for p, _ in BAD_PARAMETERS])
def test_bad_parameters(validation: Validation, parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        generate(validation, **parameters)
    assert message in str(info.value)


# Constraints that compile but meet a limit of llguidance's at their first token, in what they force from the
# start (a shard would end the request after that token); and the message's fragment.
PAST_LIMITS = [
    ({"type": "regex", "value": "a{1000000}"}, "invalid regex: lexer error: too many expressions constructed"),
    ({"type": "regex", "value": "(a{1000}){1000}"}, "invalid regex: lexer error"),
    ({"type": "json", "value": {"type": "string", "pattern": "^a{1000000}$"}}, "invalid json schema: lexer error"),
    (
        {"type": "json", "value": {"type": "array", "items": {"const": "a"}, "minItems": 1000000}},
        "invalid json schema: parser error: Too many items",
    ),
    ({"type": "grammar", "value": 'start: "a"{1000000}'}, "invalid grammar: parser error: Too many items"),
    ({"type": "grammar", "value": "start: /a{1000000}/"}, "invalid grammar: lexer error"),
    ({"type": "choice", "value": [f"option {i}" for i in range(10000)]}, "invalid choice: Parser Error: Current row"),
]
# Large, but generated step by step within the limits: they pass.
LARGE_BUT_FINE = [
    {"type": "regex", "value": "a{1000}"},
    {"type": "regex", "value": "[ab]{1000000}"},
    {"type": "regex", "value": "a{0,1000000}"},
    {"type": "json", "value": {"type": "string", "minLength": 1000000}},
    {"type": "json", "value": {"type": "array", "items": {"type": "integer"}, "maxItems": 1000000}},
    {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{1000000}"}}}},
    {"type": "choice", "value": [f"option {i}" for i in range(1000)]},
]


@pytest.mark.parametrize(("grammar", "message"), PAST_LIMITS, ids=[g["type"] for g, _ in PAST_LIMITS])
def test_a_constraint_past_llguidance_limits_at_its_first_token_is_refused(
    validation: Validation, grammar: dict, message: str
) -> None:
    """llguidance compiles lazily; validation takes the first step too, so this is a 422 and not an answer of
    one token."""
    with pytest.raises(ValidationError) as info:
        generate(validation, grammar=grammar)
    assert message in str(info.value) and str(info.value).endswith("(at the first token)"), str(info.value)


@pytest.mark.parametrize("grammar", LARGE_BUT_FINE, ids=[json.dumps(g)[:60] for g in LARGE_BUT_FINE])
def test_a_large_constraint_within_the_limits_passes(validation: Validation, grammar: dict) -> None:
    assert generate(validation, grammar=grammar).parameters.grammar is not None


BAD_BODIES = [
    (None, "JSON object"),
    ([], "JSON object"),
    ("hello", "JSON object"),
    ({}, "missing field `inputs`"),
    ({"parameters": {}}, "missing field `inputs`"),
    ({"inputs": 5}, "`inputs` must be a string"),
    ({"inputs": None}, "`inputs` must be a string"),
    ({"inputs": ["a"]}, "`inputs` must be a string"),
    ({"inputs": ""}, "`inputs` cannot be empty"),
    ({"inputs": "\udfff"}, "`inputs` must be valid Unicode"),
    ({"inputs": "a", "parameters": []}, "`parameters` must be a JSON object"),
    ({"inputs": "a", "parameters": "temperature=1"}, "`parameters` must be a JSON object"),
    ({"inputs": "a", "stream": "yes"}, "`stream` must be a boolean"),
    ({"inputs": "a", "input": "b"}, "unknown field `input`"),
]


@pytest.mark.parametrize(("body", "message"), BAD_BODIES, ids=[repr(b) for b, _ in BAD_BODIES])
def test_bad_bodies(validation: Validation, body: object, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        validation.validate(body, stream=False)
    assert message in str(info.value)


def test_decoder_input_details_cannot_stream(validation: Validation) -> None:
    with pytest.raises(ValidationError, match="`decoder_input_details`.*streaming"):
        generate(validation, stream=True, decoder_input_details=True)
    assert generate(validation, stream=True, decoder_input_details=False).parameters.decoder_input_details is False


def test_too_many_input_tokens(validation: Validation, tokenizer: Any) -> None:
    text = "the quick brown fox " * 20
    n = len(prompt_ids(tokenizer, text))
    with pytest.raises(ValidationError) as info:
        validation.validate({"inputs": text}, stream=False)
    assert str(info.value) == f"`inputs` must have less than 32 tokens. Given: {n}"


def test_too_many_total_tokens(validation: Validation, tokenizer: Any) -> None:
    n = len(prompt_ids(tokenizer))
    with pytest.raises(ValidationError) as info:
        generate(validation, max_new_tokens=64 - n + 1)
    assert str(info.value) == (
        f"`inputs` tokens + `max_new_tokens` must be <= 64. "
        f"Given: {n} `inputs` tokens and {64 - n + 1} `max_new_tokens`"
    )


def test_huge_max_new_tokens(validation: Validation) -> None:
    with pytest.raises(ValidationError, match="`max_new_tokens` must be <= 64"):
        generate(validation, max_new_tokens=10**30)


def test_no_room_for_a_default_max_new_tokens(tokenizer: Any) -> None:
    """Limits that admit a prompt filling the whole total leave nothing to generate: say so, do not return 0."""
    n = len(prompt_ids(tokenizer))
    validation = Validation(tokenizer, Limits(max_input_tokens=n, max_total_tokens=n))
    with pytest.raises(ValidationError, match="no room for new tokens"):
        generate(validation)


class _EmptyTokenizer:
    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return []


class _BrokenTokenizer:
    def encode(self, text: str, **kwargs: Any) -> list[int]:
        raise TypeError("cannot encode")


def test_empty_token_list_is_rejected() -> None:
    with pytest.raises(ValidationError, match="`inputs` tokenizes to no tokens"):
        generate(Validation(_EmptyTokenizer(), LIMITS))


def test_tokenizer_failure_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="`inputs` could not be tokenized"):
        generate(Validation(_BrokenTokenizer(), LIMITS))


# --- Fuzz: nothing but ValidationError, whatever the JSON ----------------------------------------------------

ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2**64,
    -(2**64),
    10**400,
    1e308,
    -1e308,
    1e-320,
    0.5,
    "",
    "x",
    "NaN",
    [],
    [1],
    [None],
    {},
    {"a": 1},
    {"inputs": "x"},
    [[[]]],
    {"": {"": {}}},
    json.loads("NaN"),
    json.loads("Infinity"),
    json.loads("-Infinity"),
    json.loads('"\\ud800"'),
]

TGI_PARAMETER_NAMES = [
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "do_sample",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "max_new_tokens",
    "stop",
    "ignore_eos",
    "details",
    "decoder_input_details",
    "return_full_text",
    "top_n_tokens",
    "truncate",
    "best_of",
    "watermark",
    "grammar",
    "adapter_id",
]
PARAMETER_NAMES = [
    *TGI_PARAMETER_NAMES,
    "bogus",
    "",
]


def _fuzz_bodies() -> list[object]:
    bodies: list[object] = list(ODD_VALUES)
    bodies += [{"inputs": value} for value in ODD_VALUES]
    bodies += [{"inputs": "a", "parameters": value} for value in ODD_VALUES]
    bodies += [{"parameters": {"temperature": "hot"}}, {"inputs": {"inputs": {"inputs": "a"}}}]
    bodies += [{"inputs": "a", "parameters": {name: value}} for name in PARAMETER_NAMES for value in ODD_VALUES]
    bodies += [{"inputs": "a", "parameters": {"stop": [value]}} for value in ODD_VALUES]
    bodies += [json.loads(text) for text in ('{"inputs": "a", "parameters": {"top_p": NaN}}', "[NaN, Infinity]")]
    rng = random.Random(0)
    for _ in range(300):
        parameters = {rng.choice(PARAMETER_NAMES): rng.choice(ODD_VALUES) for _ in range(rng.randint(1, 4))}
        bodies.append({"inputs": rng.choice(["a", "", 3, "\ud800"]), "parameters": parameters})
    return bodies


@pytest.mark.parametrize("stream", [False, True])
def test_fuzz_raises_only_validation_errors(validation: Validation, stream: bool) -> None:
    accepted = 0
    for body in _fuzz_bodies():
        try:
            valid = validation.validate(body, stream=stream)
        except ValidationError as exc:
            assert str(exc), f"empty message for {body!r}"
            continue
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{type(exc).__name__}: {exc} for body {body!r}")
        accepted += 1
        assert isinstance(valid, ValidRequest)
        assert valid.parameters.max_new_tokens >= 1
    assert accepted > 0  # the fuzz also reaches the happy path (null parameters, valid values)


@pytest.mark.parametrize("name", ["temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty"])
@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_rejected(validation: Validation, name: str, text: str) -> None:
    body = json.loads(f'{{"inputs": "a", "parameters": {{"{name}": {text}}}}}')
    with pytest.raises(ValidationError, match=f"`{name}` must be a finite number"):
        validation.validate(body, stream=False)


def test_huge_integer_where_a_float_is_expected(validation: Validation) -> None:
    with pytest.raises(ValidationError, match="`temperature` must be a finite number"):
        generate(validation, temperature=10**400)
