"""Request validation: the one internal request in, a `ValidRequest` or a `ValidationError` out.

Two stages. The first is each API's schema (`router/api/`), which checks the body's shape, JSON types and
bounds, then its mapping onto the one internal request (`router/pipeline/request.py`). The second, here, is one
call for every front door (`Validation.validate`), in one order: the deployment's `limited` bounds (stop
sequences, alternatives per token, `truncate`, token counts), the prompt's own checks, compiling a constraint,
the prompt's tokens and the token budget, then the model's own sampling defaults and a seed. Everything the
router hands to the shards passes through both, so a malformed value stops here with a message a user can act on
(HTTP answers 422, gRPC INVALID_ARGUMENT) rather than a 500 or a crash further down.
"""

from __future__ import annotations

import contextvars
import functools
import random
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from conveyor import tracing
from conveyor.grammar import Constraint, GrammarCache, GrammarError
from conveyor.router.api.base import ValidationError, limits_of, parse
from conveyor.router.api.tgi import Sampling
from conveyor.router.limits import Limits
from conveyor.router.pipeline.chat_prompt import Span
from conveyor.router.pipeline.fair_workers import FairWorkers
from conveyor.router.pipeline.generation_defaults import GenerationDefaults
from conveyor.router.pipeline.image_urls import ImageUrls
from conveyor.router.pipeline.images import ImageLimits, ImageReader
from conveyor.router.pipeline.output_parsers import OutputParsers
from conveyor.router.pipeline.request import Request, ValidRequest
from conveyor.router.pipeline.rerank_prompt import RerankPair, rerank_parts

__all__ = ["Validation", "ValidationError"]

# Threads that tokenize and validate, off the event loop (TGI's validation workers).
VALIDATION_WORKERS = 2


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


class UnknownAdapter(ValidationError):
    """A request names a LoRA adapter the server does not serve: a problem with the request, answered 404 (not
    422) with the names the server does serve."""

    @classmethod
    def naming(cls, name: str, served: Collection[str]) -> UnknownAdapter:
        names = ", ".join(sorted(served)) or "none"
        return cls(f"adapter {name!r} is not served (served adapters: {names})")


class Validation:
    def __init__(
        self,
        tokenizer: Any,
        limits: Limits,
        on_compile: Callable[[float], None] | None = None,
        model_dir: str | None = None,
        chat_special_tokens: bool = False,
        adapters: Callable[[], Collection[str]] = tuple,
        parsers: OutputParsers | None = None,
        image_limits: ImageLimits | None = None,
        image_urls: ImageUrls | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # How the model writes tool calls and reasoning (output_parsers.py), for the chat routes.
        self.parsers = parsers or OutputParsers()
        self.adapters = adapters  # the LoRA adapters served now (they change as adapters are loaded live)
        # Whether special tokens written in chat messages are control tokens (trusted callers only; chat_prompt.py).
        self.chat_special_tokens = chat_special_tokens
        self.special_texts = tuple(getattr(tokenizer, "all_special_tokens", ()))
        self.limits = limits
        # The model's generation_config.json sampling, for what a request leaves unset (none without a model_dir).
        self.defaults = GenerationDefaults.read(model_dir, self.check_parameter) if model_dir else GenerationDefaults()
        # An image-text checkpoint's processor, else None.
        self.images = ImageReader.load(model_dir, tokenizer, image_limits, image_urls)
        self.grammars = GrammarCache(tokenizer, None)
        self.on_compile = on_compile  # told the seconds each new grammar took to compile (a metric)
        executor = ThreadPoolExecutor(VALIDATION_WORKERS, thread_name_prefix="validation")
        self._workers = FairWorkers(executor, VALIDATION_WORKERS)
        # The most characters one token covers (raw vocabulary strings: a byte-level token has one character
        # per byte, so never fewer than its text): a prompt longer than the token limit times this cannot fit.
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)

    async def off_loop(self, fn: Callable[..., Any], *args: Any, owner: str = "", **kwargs: Any) -> Any:
        """Runs `fn` (parsing, tokenizing, rendering a chat template) on a validation worker, in `owner`'s turn
        (an API key's name: fair_workers.py). Tokenizing a prompt of a few megabytes takes a thread for long: on the
        event loop it froze every running stream that long. The caller's context (its trace span) goes along."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await self._workers.run(owner, call)

    def validate(self, request: Request) -> ValidRequest:
        """Every front door's one call, after its schema and mapping: what depends on the deployment and on the
        prompt. Runs on a validation worker (`off_loop`): tokenizing and compiling take a thread."""
        with tracing.span("validate"):
            if request.body is not None:
                check_limits(request.body, self.limits, request.where)
            if request.pooling is not None:
                return self._validate_prompt_only(request)
            return self._validate_prompt(request)

    def _validate_prompt(self, request: Request) -> ValidRequest:
        inputs, parameters = request.inputs, request.parameters
        if not inputs:  # the schemas say so already; gRPC's strings may be empty
            raise ValidationError("`inputs` cannot be empty")
        if request.stream and parameters.decoder_input_details:
            raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
        if parameters.grammar is not None:
            self.check_grammar(parameters.grammar)
        text, pixels = inputs, []
        if request.markdown_images and self.images is not None:
            text, pixels = self.images.markdown(inputs)
        input_ids = self._input_ids(text, parameters.truncate, request.add_special_tokens, request.plain_spans)
        if pixels:
            parameters = replace(parameters, images=self.images.place(input_ids, pixels))
        max_new_tokens = _resolve_max_new_tokens(parameters.max_new_tokens, len(input_ids), self.limits)
        sampling = _with_seed(self.defaults.apply(parameters.sampling))
        adapter = self._adapter(request)
        parameters = replace(parameters, sampling=sampling, max_new_tokens=max_new_tokens, adapter=adapter)
        return ValidRequest(inputs=inputs, input_ids=input_ids, parameters=parameters)

    def _validate_prompt_only(self, request: Request) -> ValidRequest:
        """An embeddings or rerank input: its token ids as given, or its text's (a reranker's prompt in the model
        card's pieces), within the input limit (or cut to `truncate` tokens, keeping the start, as TEI does);
        nothing is generated."""
        truncate = request.parameters.truncate
        if request.input_ids is not None:
            input_ids = self._given_ids(request.input_ids)
        elif request.rerank is not None:
            input_ids = self._rerank_ids(request.rerank, truncate)
        elif not request.inputs:
            raise ValidationError("`inputs` cannot be empty")
        else:
            input_ids = self._head_ids(request.inputs, truncate)
        _check_input_length(len(input_ids), self.limits)
        parameters = replace(request.parameters, max_new_tokens=0, adapter=self._adapter(request))
        return ValidRequest(request.inputs, tuple(int(i) for i in input_ids), parameters, pooling=request.pooling)

    def _given_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        vocabulary = len(self.tokenizer)
        if outside := [i for i in ids if i >= vocabulary]:
            raise ValidationError(f"token ids {outside[:5]} are outside the vocabulary (size {vocabulary})")
        return ids

    def _head_ids(self, text: str, truncate: int | None, add_special_tokens: bool = True) -> list[int]:
        """The text's tokens, cut to the first `truncate` of them if given (the tokenizer's own truncation, which
        keeps the special tokens it adds); unbounded text is refused before it is tokenized, as `_bounded` does."""
        if truncate is None:
            text = self._bounded(text, None)
        else:
            text = text[: (truncate + 2) * self.max_token_chars]
        cut = {"truncation": True, "max_length": truncate} if truncate is not None else {}
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False, **cut)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this input's fault
            raise ValidationError(f"`inputs` could not be tokenized: {exc}") from None

    def _rerank_ids(self, pair: RerankPair, truncate: int | None) -> tuple[int, ...]:
        """Head, pair and tail tokenized one by one, as Qwen3-Reranker's model card does; `truncate` cuts the pair
        so that the whole is at most that long."""
        head, middle, tail = rerank_parts(pair.query, pair.document)
        fixed = [self._head_ids(head, None, False), self._head_ids(tail, None, False)]
        room = None if truncate is None else truncate - len(fixed[0]) - len(fixed[1])
        if room is not None and room < 1:
            raise ValidationError(f"the reranker's prompt leaves no room for the query and document in {truncate}")
        return tuple(fixed[0] + self._head_ids(middle, room, False) + fixed[1])

    def _adapter(self, request: Request) -> str | None:
        """The adapter a request asks for by name (TGI's and gRPC's `adapter_id`), which must be served; or the one
        OpenAI's `model` names, where it names one (any other `model` is the base model's)."""
        served = self.adapters()
        asked = request.parameters.adapter
        if asked is not None and asked not in served:
            raise UnknownAdapter.naming(asked, served)
        if asked is None and request.model is not None and request.model in served:
            return request.model
        return asked

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

    def _input_ids(
        self, inputs: str, truncate: int | None, add_special_tokens: bool, plain_spans: tuple[Span, ...] = ()
    ) -> tuple[int, ...]:
        """Truncation keeps the end of the prompt, as TGI does: the most recent text matters most. Within
        `plain_spans` a special token's text is text (the tokenizer's `split_special_tokens`)."""
        inputs = self._bounded(inputs, truncate)
        try:
            if plain_spans:
                ids = self._encode_spans(inputs, plain_spans)
            else:
                ids = self.tokenizer.encode(inputs, add_special_tokens=add_special_tokens, verbose=False)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this input's fault
            raise ValidationError(f"`inputs` could not be tokenized: {exc}") from None
        if truncate is not None:
            ids = ids[-truncate:]
        input_ids = tuple(int(i) for i in ids)
        _check_input_length(len(input_ids), self.limits)
        return input_ids

    def _bounded(self, inputs: str, truncate: int | None) -> str:
        """Refuses, before tokenizing it, a prompt with more characters than the token limit can hold (tokenizing
        megabytes takes seconds of a thread every key shares); with `truncate`, only the tail that can hold that
        many tokens (and a little more, so the cut falls on tokens truncation drops) is tokenized."""
        longest = self.max_token_chars
        if truncate is not None:
            keep = (truncate + 2) * longest
            return inputs[-keep:] if len(inputs) > keep else inputs
        limit = self.limits.max_input_tokens * longest
        if len(inputs) > limit:
            raise ValidationError(
                f"`inputs` has {len(inputs)} characters, more than {self.limits.max_input_tokens} tokens can hold "
                f"({limit}): at most {self.limits.max_input_tokens} input tokens"
            )
        return inputs

    def _encode_spans(self, text: str, plain_spans: tuple[Span, ...]) -> list[int]:
        """The template's pieces with special tokens recognised, the caller's spans without; no added BOS (a
        chat template writes its own)."""
        encode, ids, at = self.tokenizer.encode, [], 0
        for start, stop in plain_spans:
            ids += encode(text[at:start], add_special_tokens=False, verbose=False) if start > at else []
            ids += encode(text[start:stop], add_special_tokens=False, split_special_tokens=True, verbose=False)
            at = stop
        return ids + (encode(text[at:], add_special_tokens=False, verbose=False) if at < len(text) else [])

    def token_offsets(self, valid: ValidRequest) -> list[tuple[int, str, int, int]]:
        """(id, text, start, stop) of each prompt token, with character offsets into the (truncated) prompt:
        what /tokenize and the gRPC Tokenize answer."""
        offsets = self.tokenizer(valid.inputs, return_offsets_mapping=True)["offset_mapping"]
        return [
            (i, valid.inputs[start:stop], start, stop)
            for i, (start, stop) in zip(valid.input_ids, offsets[-len(valid.input_ids) :])
        ]
