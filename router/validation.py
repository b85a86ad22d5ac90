"""Request validation: an untrusted JSON body in, a `ValidRequest` or a `ValidationError` out.

Everything the router hands to the shards passes through here, so every malformed value must stop here with a
message a user can act on (the HTTP layer turns `ValidationError` into a 422). Anything else escaping would be
a 500 for what is really the client's mistake, or worse, a crash further down (a protobuf overflow, a lone
surrogate that cannot be encoded), so the checks are strict about JSON types: `true` is not a number, `5.0` is
not an integer, and NaN or infinity is not a float, even though Python would happily accept all three.

The rules and messages follow text-generation-inference's, so TGI clients behave the same against Conveyor.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import math
import random
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from conveyor.router.generation_defaults import GenerationDefaults

from conveyor import tracing
from conveyor.grammar import Constraint, GrammarCache, GrammarError

# Protobuf fields these values end up in (uint64 seed, uint32 top_k): larger values would fail at send time.
SEED_LIMIT = 2**64
UINT32_MAX = 2**32 - 1
# Sampling floats travel to the shards as float32, where a positive value below ~1e-45 is 0, which the shard reads
# as "unset" (1.0): `temperature: 1e-50` sampled at temperature 1, `top_p: 1e-50` from the whole vocabulary. So
# smaller values of temperature, top_p, typical_p and repetition_penalty are taken as this floor, where the
# shard already picks the most likely token (it clamps temperature there itself).
MIN_POSITIVE = 1e-6
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
# Deeper JSON than any real request needs; deeper bodies are refused before anything walks them recursively.
MAX_JSON_DEPTH = 32
# Threads that tokenize and validate, off the event loop (TGI's validation workers).
VALIDATION_WORKERS = 2
# `stream` is what huggingface_hub's InferenceClient puts beside `inputs`; the route, not the body, decides it.
_BODY_KEYS = frozenset({"inputs", "parameters", "stream"})


class ValidationError(ValueError):
    """A problem with the request itself: the HTTP layer answers 422 with this message."""


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_new_tokens_default: int | None = None  # None: default max_new_tokens = max_total_tokens - input_length


@dataclass(frozen=True)
class Parameters:
    """Validated generation parameters, under TGI's names."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int | None = None  # filled by the validator when sampling and not given; stays None for greedy
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int = 0  # always set after validation
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    top_n_tokens: int = 0
    truncate: int | None = None
    grammar: Constraint | None = None  # structured output: what the text must match

    @property
    def sampling(self) -> bool:
        """TGI's rule: any warper that reshapes the distribution implies sampling from it, not argmax."""
        return self.do_sample or self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0


@dataclass(frozen=True)
class ValidRequest:
    inputs: str
    input_ids: tuple[int, ...]
    parameters: Parameters


# --- JSON type checks -------------------------------------------------------------------------------------


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"`{name}` must be a boolean")
    return value


def _int(name: str, value: object) -> int:
    # bool is a subclass of int in Python, but `true` is not a number in JSON.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"`{name}` must be an integer")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"`{name}` must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer literal too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise ValidationError(f"`{name}` must be a finite number")
    return number


def _text(name: str, value: object) -> str:
    """Lone surrogates (which json.loads accepts from `\\ud800`) cannot be encoded for the tokenizer or protobuf."""
    if not isinstance(value, str):
        raise ValidationError(f"`{name}` must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"`{name}` must be valid Unicode text (it contains a lone surrogate)") from None
    return value


# --- Per-parameter rules ------------------------------------------------------------------------------------

# A check takes the parameter's (non-null) JSON value and the limits, and returns the value for `Parameters`.
Check = Callable[[object, Limits], Any]


def _strictly_positive(name: str, maximum: float) -> Check:
    """TGI's rule (> 0), with a ceiling: `temperature: 1e308` is no request anyone means, and on the float32 wire it
    is infinity, which turns logits into NaN."""

    def check(value: object, limits: Limits) -> float:
        number = _float(name, value)
        if number <= 0:
            raise ValidationError(f"`{name}` must be strictly positive")
        if number > maximum:
            raise ValidationError(f"`{name}` must be strictly positive and <= {maximum:g}. Given: {number:g}")
        return max(number, MIN_POSITIVE)

    return check


def _penalty(name: str) -> Check:
    def check(value: object, limits: Limits) -> float:
        number = _float(name, value)
        if not -2.0 <= number <= 2.0:
            raise ValidationError(f"`{name}` must be >= -2.0 and <= 2.0")
        return number

    return check


def _probability(name: str) -> Check:
    """1.0 means "off", and 0 would leave no token to choose from, hence (0, 1]."""

    def check(value: object, limits: Limits) -> float:
        number = _float(name, value)
        if not 0.0 < number <= 1.0:
            raise ValidationError(f"`{name}` must be > 0.0 and <= 1.0")
        return max(number, MIN_POSITIVE)

    return check


def _flag(name: str) -> Check:
    def check(value: object, limits: Limits) -> bool:
        return _bool(name, value)

    return check


def _top_k(value: object, limits: Limits) -> int:
    top_k = _int("top_k", value)
    if top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    if top_k > UINT32_MAX:
        raise ValidationError(f"`top_k` must be <= {UINT32_MAX}")
    return top_k


def _seed(value: object, limits: Limits) -> int:
    seed = _int("seed", value)
    if not 0 <= seed < SEED_LIMIT:
        raise ValidationError("`seed` must be >= 0 and < 2^64")
    return seed


def _max_new_tokens(value: object, limits: Limits) -> int:
    # The upper bound depends on the input length, so it is checked after tokenizing.
    max_new_tokens = _int("max_new_tokens", value)
    if max_new_tokens < 1:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    return max_new_tokens


def _stop(value: object, limits: Limits) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValidationError("`stop` must be a list of strings")
    if len(value) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(value)}")
    stop = tuple(_text("stop", item) for item in value)
    if any(not item for item in stop):
        raise ValidationError("`stop` sequences must not be empty")
    return stop


def _top_n_tokens(value: object, limits: Limits) -> int:
    top_n = _int("top_n_tokens", value)
    if not 0 <= top_n <= limits.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {top_n}")
    return top_n


def _truncate(value: object, limits: Limits) -> int:
    truncate = _int("truncate", value)
    if not 1 <= truncate <= limits.max_input_tokens:
        raise ValidationError(
            f"`truncate` must be strictly positive and <= {limits.max_input_tokens}. Given: {truncate}"
        )
    return truncate


def _grammar(value: object, limits: Limits) -> Constraint:
    from conveyor.router.structured import tgi_grammar  # it builds on this module's errors

    return tgi_grammar(value)


_CHECKS: dict[str, Check] = {
    "temperature": _strictly_positive("temperature", MAX_TEMPERATURE),
    "top_k": _top_k,
    "top_p": _probability("top_p"),
    "typical_p": _probability("typical_p"),
    "do_sample": _flag("do_sample"),
    "seed": _seed,
    "repetition_penalty": _strictly_positive("repetition_penalty", MAX_REPETITION_PENALTY),
    "frequency_penalty": _penalty("frequency_penalty"),
    "presence_penalty": _penalty("presence_penalty"),
    "max_new_tokens": _max_new_tokens,
    "stop": _stop,
    "ignore_eos": _flag("ignore_eos"),
    "details": _flag("details"),
    "decoder_input_details": _flag("decoder_input_details"),
    "return_full_text": _flag("return_full_text"),
    "top_n_tokens": _top_n_tokens,
    "truncate": _truncate,
    "grammar": _grammar,
}


# --- TGI parameters Conveyor does not implement ---------------------------------------------------------------
# Clients such as huggingface_hub send every parameter, most as null, so the neutral value must pass; anything
# else would silently change the meaning of the request, so it is refused rather than ignored.


def _best_of(value: object) -> None:
    best_of = _int("best_of", value)
    if best_of < 1:
        raise ValidationError("`best_of` must be strictly positive")
    if best_of > 1:
        raise ValidationError("`best_of` > 1 is not supported")


def _watermark(value: object) -> None:
    if _bool("watermark", value):
        raise ValidationError("`watermark` is not supported")


def _must_be_null(name: str) -> Callable[[object], None]:
    def check(value: object) -> None:
        raise ValidationError(f"`{name}` is not supported (it must be null)")

    return check


_UNSUPPORTED: dict[str, Callable[[object], None]] = {
    "best_of": _best_of,
    "watermark": _watermark,
    "adapter_id": _must_be_null("adapter_id"),
}


def parse_parameters(parameters: Mapping[str, object], limits: Limits) -> dict[str, Any]:
    """The checked, non-null parameters as keyword arguments for `Parameters`; nulls mean "the default"."""
    fields: dict[str, Any] = {}
    for name, value in parameters.items():
        if name in _UNSUPPORTED:
            if value is not None:
                _UNSUPPORTED[name](value)
        elif name in _CHECKS:
            if value is not None:
                fields[name] = _CHECKS[name](value, limits)
        else:
            raise ValidationError(f"unknown parameter `{name}`")
    return fields


# --- Body shape -----------------------------------------------------------------------------------------------


def parse_json(raw: bytes) -> object:
    """A request body as JSON, or a ValidationError: malformed, not UTF-8, or nested deeper than MAX_JSON_DEPTH
    (the parser itself recurses, so a body nested 100k deep would otherwise end in a RecursionError)."""
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except RecursionError:
        raise ValidationError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # malformed, not UTF-8, NaN or Infinity, an integer of over 4300 digits
        raise ValidationError(f"request body is not valid JSON: {exc}") from None
    _check_depth(body)
    return body


def _not_json(constant: str) -> None:
    """Python's parser accepts NaN, Infinity and -Infinity, which JSON does not have."""
    raise ValueError(f"{constant} is not a JSON value")


def _check_depth(value: object) -> None:
    """Iterative, so that checking a deep value cannot itself overflow the stack."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth >= MAX_JSON_DEPTH:
            raise ValidationError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children)


def _body_fields(body: object) -> tuple[str, dict[str, object]]:
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object with a string `inputs`")
    unknown = sorted(key for key in body if key not in _BODY_KEYS)
    if unknown:
        raise ValidationError(f"unknown field `{unknown[0]}` in request body (expected `inputs` and `parameters`)")
    if "inputs" not in body:
        raise ValidationError("missing field `inputs`")
    stream = body.get("stream")
    if stream is not None:
        _bool("stream", stream)
    parameters = body.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise ValidationError("`parameters` must be a JSON object")
    return body["inputs"], parameters


# --- Token budget -------------------------------------------------------------------------------------------


def _check_input_length(n: int, limits: Limits) -> None:
    if n == 0:
        raise ValidationError("`inputs` tokenizes to no tokens")
    if n > limits.max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {n}")


def _resolve_max_new_tokens(requested: int | None, n: int, limits: Limits) -> int:
    """A configured default is capped at the room left, so an unset value never fails for a prompt that fits."""
    room = limits.max_total_tokens - n
    if requested is None:
        if room < 1:
            raise ValidationError(
                f"`inputs` has {n} tokens, which leaves no room for new tokens within "
                f"{limits.max_total_tokens} total tokens"
            )
        default = limits.max_new_tokens_default
        return room if default is None else min(default, room)
    if n + requested > limits.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {n} `inputs` tokens and {requested} `max_new_tokens`"
        )
    return requested


def _with_seed(parameters: Parameters) -> Parameters:
    """Sampling needs a seed the response can report, so that a user can replay the same generation."""
    if parameters.sampling and parameters.seed is None:
        return replace(parameters, seed=random.getrandbits(63))
    return parameters


class Validation:
    def __init__(
        self,
        tokenizer: Any,
        limits: Limits,
        on_compile: Callable[[float], None] | None = None,
        model_dir: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        # The model's generation_config.json sampling, for what a request leaves unset (none without a model_dir).
        self.defaults = GenerationDefaults.read(model_dir, self.check_parameter) if model_dir else GenerationDefaults()
        self.grammars = GrammarCache(tokenizer, None)
        self.on_compile = on_compile  # told the seconds each new grammar took to compile (a metric)
        self._workers = ThreadPoolExecutor(VALIDATION_WORKERS, thread_name_prefix="validation")

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs `fn` (parsing, tokenizing, rendering a chat template) on a validation worker. Tokenizing a
        prompt of a few megabytes takes over a second: on the event loop it froze every running stream that
        long. The caller's context (its trace span) goes along."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._workers, call)

    def validate_json(self, raw: bytes, *, stream: bool) -> ValidRequest:
        return self.validate(parse_json(raw), stream=stream)

    def validate(self, body: object, *, stream: bool) -> ValidRequest:
        inputs, parameters = _body_fields(body)
        return self.validate_prompt(inputs, parameters, stream=stream)

    def validate_prompt(
        self, inputs: str, parameters: dict, *, stream: bool = False, add_special_tokens: bool = True
    ) -> ValidRequest:
        """The shared core: OpenAI-style routes map their own fields onto TGI's names and call this.
        A chat template renders its own special tokens, so chat prompts pass `add_special_tokens=False`."""
        with tracing.span("validate"):
            return self._validate_prompt(inputs, parameters, stream, add_special_tokens)

    def _validate_prompt(self, inputs: str, parameters: dict, stream: bool, add_special_tokens: bool) -> ValidRequest:
        inputs = _text("inputs", inputs)
        if not inputs:
            raise ValidationError("`inputs` cannot be empty")
        if not isinstance(parameters, dict):
            raise ValidationError("`parameters` must be a JSON object")
        fields = self.defaults.apply(parse_parameters(parameters, self.limits))
        if stream and fields.get("decoder_input_details"):
            raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
        if "grammar" in fields:
            self.check_grammar(fields["grammar"])
        input_ids = self._input_ids(inputs, fields.get("truncate"), add_special_tokens)
        fields["max_new_tokens"] = _resolve_max_new_tokens(fields.get("max_new_tokens"), len(input_ids), self.limits)
        return ValidRequest(inputs=inputs, input_ids=input_ids, parameters=_with_seed(Parameters(**fields)))

    def check_parameter(self, name: str, value: object) -> Any:
        """One TGI parameter checked as in a request (ValidationError, a ValueError, if refused)."""
        return _CHECKS[name](value, self.limits)

    def check_grammar(self, constraint: Constraint) -> None:
        """Compiles the constraint (once per distinct one: the cache keeps it), so that a bad schema or regex is
        this request's 422 and never a shard's error. Called on a validation worker, off the event loop."""
        try:
            seconds = self.grammars.compile(constraint.grammar)
        except GrammarError as exc:
            raise ValidationError(f"invalid {constraint.kind.replace('_', ' ')}: {exc}") from None
        if seconds and self.on_compile is not None:
            self.on_compile(seconds)

    def _input_ids(self, inputs: str, truncate: int | None, add_special_tokens: bool) -> tuple[int, ...]:
        """Truncation keeps the end of the prompt, as TGI does: the most recent text matters most."""
        try:
            ids = self.tokenizer.encode(inputs, add_special_tokens=add_special_tokens, verbose=False)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this input's fault
            raise ValidationError(f"`inputs` could not be tokenized: {exc}") from None
        if truncate is not None:
            ids = ids[-truncate:]
        input_ids = tuple(int(i) for i in ids)
        _check_input_length(len(input_ids), self.limits)
        return input_ids

    def token_offsets(self, valid: ValidRequest) -> list[tuple[int, str, int, int]]:
        """(id, text, start, stop) of each prompt token, with character offsets into the (truncated) prompt:
        what /tokenize and the gRPC Tokenize answer."""
        offsets = self.tokenizer(valid.inputs, return_offsets_mapping=True)["offset_mapping"]
        return [
            (i, valid.inputs[start:stop], start, stop)
            for i, (start, stop) in zip(valid.input_ids, offsets[-len(valid.input_ids) :])
        ]
