"""Request validation: an untrusted body in, a `ValidRequest` or a `ValidationError` out.

Two stages. The first is each API's schema (`router/api/`), which checks the body's shape, JSON types and
bounds, then its mapping onto the one internal request (`router/request.py`). The second, here, is what depends
on the deployment and the prompt: the `limited` bounds (stop sequences, alternatives per token, `truncate`), the
prompt's tokens and the token budget, the model's own sampling defaults, and compiling a constraint. Everything
the router hands to the shards passes through both, so a malformed value stops here with a message a user can act
on (HTTP answers 422, gRPC INVALID_ARGUMENT) rather than a 500 or a crash further down.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from conveyor.router.api.base import ValidationError, limits_of, parse
from conveyor.router.api.tgi import GenerateParameters, GenerateRequest, Sampling
from conveyor.router.generation_defaults import GenerationDefaults
from conveyor.router.request import Parameters, ValidRequest, from_tgi
from pydantic import BaseModel

from conveyor import tracing
from conveyor.grammar import Constraint, GrammarCache, GrammarError

__all__ = ["Limits", "Validation", "ValidationError"]

# Threads that tokenize and validate, off the event loop (TGI's validation workers).
VALIDATION_WORKERS = 2


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_new_tokens_default: int | None = None  # None: default max_new_tokens = max_total_tokens - input_length


# --- Body shape -----------------------------------------------------------------------------------------------


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


def _with_seed(sampling: Sampling) -> Sampling:
    """Sampling needs a seed the response can report, so that a user can replay the same generation."""
    if sampling.samples and sampling.seed is None:
        return sampling.model_copy(update={"seed": random.getrandbits(63)})
    return sampling


def check_limits(request: BaseModel, limits: Limits, where: str = "") -> None:
    """The second stage: the bounds the schema leaves to the deployment (`limited` fields)."""
    for name, (limit, minus) in limits_of(type(request)).items():
        value = getattr(request, name)
        if value is None:
            continue
        bound = getattr(limits, limit) - minus
        count = len(value) if isinstance(value, list) else 1 if isinstance(value, str) else value
        if count > bound:
            what = "items" if isinstance(value, (list, str)) else ""
            raise ValidationError(
                f"`{where}{name}` must be at most {bound}{' ' + what if what else ''} on this server "
                f"({limit}). Given: {count}"
            )


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

    def validate(self, body: bytes | object, *, stream: bool, stream_field: bool = True) -> ValidRequest:
        """A TGI body (`/generate`, `/generate_stream`, `/` and `/tokenize`), as bytes or Python values. The body's
        `stream` picks the answer on `/` only: elsewhere (`stream_field` False) `stream: true` is refused rather
        than silently answered in one piece."""
        request = parse(GenerateRequest, body)
        if request.stream and not stream_field:
            raise ValidationError("`stream` is read on `/` only: POST to /generate_stream for server-sent events")
        return self.validate_tgi(request.inputs, request.parameters, stream=stream)

    def validate_tgi(
        self, inputs: str, request: GenerateParameters, *, stream: bool, grammar: Constraint | None = None
    ) -> ValidRequest:
        """TGI's parameters, from HTTP's body or gRPC's message (whose constraint comes as `grammar`)."""
        check_limits(request, self.limits, "parameters.")
        parameters = from_tgi(request)
        if grammar is not None:
            parameters = replace(parameters, grammar=grammar)
        return self.validate_prompt(inputs, parameters, stream=stream)

    def validate_prompt(
        self, inputs: str, parameters: Parameters, *, stream: bool = False, add_special_tokens: bool = True
    ) -> ValidRequest:
        """The second stage, after each API's schema and mapping: what depends on the prompt and on the
        deployment. A chat template renders its own special tokens, so chat prompts pass
        `add_special_tokens=False`."""
        with tracing.span("validate"):
            return self._validate_prompt(inputs, parameters, stream, add_special_tokens)

    def _validate_prompt(
        self, inputs: str, parameters: Parameters, stream: bool, add_special_tokens: bool
    ) -> ValidRequest:
        if not inputs:  # the schemas say so already; gRPC's strings may be empty
            raise ValidationError("`inputs` cannot be empty")
        if stream and parameters.decoder_input_details:
            raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
        if parameters.grammar is not None:
            self.check_grammar(parameters.grammar)
        input_ids = self._input_ids(inputs, parameters.truncate, add_special_tokens)
        max_new_tokens = _resolve_max_new_tokens(parameters.max_new_tokens, len(input_ids), self.limits)
        sampling = _with_seed(self.defaults.apply(parameters.sampling))
        parameters = replace(parameters, sampling=sampling, max_new_tokens=max_new_tokens)
        return ValidRequest(inputs=inputs, input_ids=input_ids, parameters=parameters)

    def check_parameter(self, name: str, value: object) -> Any:
        """One sampling parameter checked as in a request (ValidationError, a ValueError, if refused)."""
        return getattr(parse(Sampling, {name: value}), name)

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
