"""The one internal request every front door's types become (`Request`), and the one mapping from each API's
types to it: `tgi_request` / `from_tgi` (HTTP's and gRPC's TGI parameters), `from_completion`, `from_chat`, and the
prompt-only requests of the embeddings and rerank APIs (`from_embedding_input`, `from_rerank_pair`).

A route parses its typed body, maps it here, and hands the `Request` to `Validation.validate`, the same call for
every front door. TGI's names are the router's: `from_tgi` is nearly a copy. OpenAI's routes differ in a few
places, all here: `temperature: 0` is greedy, `max_tokens` (or chat's `max_completion_tokens`) is
`max_new_tokens`, `logprobs` / `top_logprobs` are `top_n_tokens`, and the constraint comes from whichever
structured-output field carries one. The sampling fields both APIs share (`SharedSampling`) are copied by name,
so a field added to the schema needs nothing here. Which fields Conveyor refuses is declared in the schemas
(`refused`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from conveyor.grammar import Constraint
from conveyor.router.api.base import parse
from conveyor.router.api.openai import ChatRequest, CompletionRequest, OpenAIRequest
from conveyor.router.api.tgi import (
    WARPERS,
    GenerateParameters,
    GenerateRequest,
    PlainGenerateRequest,
    Sampling,
    SharedSampling,
)
from conveyor.router.pipeline.chat_prompt import ChatPrompt, Span
from conveyor.router.pipeline.images import ImageInput
from conveyor.router.pipeline.rerank_prompt import RerankPair, rerank_prompt


@dataclass(frozen=True)
class Parameters:
    """A request's parameters as every API's request becomes them (`from_tgi`, `from_completion`, `from_chat`),
    under TGI's names."""

    sampling: Sampling = Sampling()  # what the shards get
    max_new_tokens: int | None = None  # always set after validation
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    top_n_tokens: int = 0
    truncate: int | None = None
    grammar: Constraint | None = None  # structured output: what the text must match
    priority: int = 0  # lower is served first
    cache_salt: str | None = None  # whose cached prompt blocks it may share (see Sequence.cache_scope)
    speculate: int | None = None  # most draft tokens per step, within the server's (None: the server's)
    adapter: str | None = None  # the LoRA adapter its tokens go through (None: the base model)
    # The prompt's images (pipeline/images.py), which travel to the shards with the rest of these parameters.
    images: tuple[ImageInput, ...] = ()

    @property
    def seed(self) -> int | None:
        """Filled by validation when sampling and not given; None for greedy."""
        return self.sampling.seed


@dataclass(frozen=True)
class Pooling:
    """A prompt-only request (embeddings, rerank): what it takes from its prompt instead of generated tokens. It
    goes through the same queue and steps as any request and finishes at the step that reads its prompt's end."""

    task: str  # "embed": its final hidden states pooled into a vector; "rerank": the reranker's yes/no score
    mode: str = "last"  # embed: conveyor/pooling.py's mode (last, mean, cls)
    normalize: bool = True  # embed: scale the vector to unit length
    yes_token_id: int = 0  # rerank: the score is the logit of "yes" minus that of "no" at the last position
    no_token_id: int = 0

    @property
    def every_position(self) -> bool:
        """Whether it needs every prompt position computed at this request (mean, CLS): no cached prefix."""
        return self.task == "embed" and self.mode in ("mean", "cls")


@dataclass(frozen=True)
class Request:
    """What a front door hands to validation: the prompt and parameters under TGI's names, and the typed body
    whose `limited` fields the deployment bounds (errors name them as the caller wrote them, after `where`)."""

    inputs: str
    parameters: Parameters
    stream: bool = False
    body: BaseModel | None = None  # the API's typed request (or TGI's parameters) that `limited` fields bound
    where: str = ""  # the bounded fields' path in the body, for errors ("parameters.")
    add_special_tokens: bool = True  # False for a chat template's text, which writes its own special tokens
    model: str | None = None  # OpenAI's `model`: an adapter's name selects it (vLLM's convention)
    plain_spans: tuple[Span, ...] = ()  # the callers' text within a rendered chat prompt (chat_prompt.py)
    pooling: Pooling | None = None  # a prompt-only request (embeddings, rerank); None: it generates
    input_ids: tuple[int, ...] | None = None  # a prompt-only request's tokens as the caller gave them (not text)
    rerank: RerankPair | None = None  # a rerank request's pair, whose prompt is tokenized in the model card's pieces
    markdown_images: bool = False  # TGI's: `![](data URL)` in `inputs` is an image, for an image-text model


@dataclass(frozen=True)
class ValidRequest:
    inputs: str
    input_ids: tuple[int, ...]
    parameters: Parameters
    pooling: Pooling | None = None  # a prompt-only request: nothing is generated (max_new_tokens is 0)


_UNSET = Sampling()


def sampling_of(values: BaseModel, names: Any, **more: Any) -> Sampling:
    """The `Sampling` fields of `values` among `names`, and `more`, marked as given (a model's
    generation_config.json fills only what a request leaves unset)."""
    given = {name: getattr(values, name) for name in Sampling.model_fields if name in names} | more
    return _UNSET.model_copy(update=given)  # what pydantic does fastest with values already checked


def _tgi_parameters(p: GenerateParameters) -> Parameters:
    return Parameters(
        sampling=sampling_of(p, p.model_fields_set),
        max_new_tokens=p.max_new_tokens,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        details=p.details,
        decoder_input_details=p.decoder_input_details,
        return_full_text=p.return_full_text,
        top_n_tokens=p.top_n_tokens,
        truncate=p.truncate,
        grammar=p.grammar.constraint() if p.grammar is not None else None,
        priority=p.priority,
        cache_salt=p.cache_salt,
        speculate=p.speculate,
        adapter=p.adapter_id,
    )


def from_tgi(inputs: str, p: GenerateParameters, *, stream: bool, grammar: Constraint | None = None) -> Request:
    """TGI's parameters, from HTTP's body or gRPC's message (whose constraint comes as `grammar`)."""
    parameters = _tgi_parameters(p)
    if grammar is not None:
        parameters = replace(parameters, grammar=grammar)
    return Request(inputs, parameters, stream=stream, body=p, where="parameters.", markdown_images=True)


def tgi_request(body: bytes | object, *, stream: bool, stream_field: bool = True) -> Request:
    """A TGI body (`/generate`, `/generate_stream`, `/` and `/tokenize`), as bytes or Python values. The body's
    `stream` picks the answer on `/` only: elsewhere (`stream_field` False) `stream: true` is refused rather
    than silently answered in one piece."""
    request = parse(GenerateRequest if stream_field else PlainGenerateRequest, body)
    return from_tgi(request.inputs, request.parameters, stream=stream)


def from_completion(request: CompletionRequest, prompt: str) -> Request:
    """One of a completion's prompts (each is a request of its own, `n` times)."""
    parameters = _openai_parameters(request, request.max_tokens, request.logprobs, request.constraint())
    return Request(prompt, parameters, stream=request.stream, body=request, model=request.model)


def from_chat(request: ChatRequest, prompt: ChatPrompt, grammar: Constraint | None) -> Request:
    """A chat rendered by the model's template (`prompt`), under `grammar`: the body's own constraint or the
    one a forced tool call implies (tools.py). The chosen token's logprob comes with its alternatives: asking
    for logprobs reports at least one."""
    top = request.top_logprobs or int(request.logprobs)
    max_new_tokens = request.max_tokens if request.max_tokens is not None else request.max_completion_tokens
    return Request(
        prompt.text,
        _openai_parameters(request, max_new_tokens, top, grammar),
        stream=request.stream,
        body=request,
        add_special_tokens=False,
        plain_spans=prompt.plain_spans,
        model=request.model,
    )


def _openai_parameters(
    request: OpenAIRequest, max_new_tokens: int | None, top_n_tokens: int, grammar: Constraint | None
) -> Parameters:
    """Temperature 0 means greedy, and drops the warpers, which would turn sampling back on (so would the model's
    default warpers: `do_sample: false` keeps them off). Unset means sampling, at the model's default temperature
    (generation_config.json) or else 1, as OpenAI and vLLM do."""
    given = {name for name in SharedSampling.model_fields if name in request.model_fields_set}
    if request.temperature == 0:
        sampling = sampling_of(request, given - set(WARPERS), do_sample=False)
    else:
        sampling = sampling_of(request, given | {"temperature"} & request.model_fields_set, do_sample=True)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    return Parameters(
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop=tuple(stop),
        ignore_eos=request.ignore_eos,
        top_n_tokens=top_n_tokens,
        grammar=grammar,
        priority=request.priority,
        cache_salt=request.cache_salt,
        speculate=request.speculate,
    )


def from_embedding_input(value: str | list[int], pooling: Pooling, truncate: int | None, model: str | None) -> Request:
    """One input of an embeddings request (OpenAI's or TEI's): text, or token ids taken as they are. `truncate`: the
    most tokens kept, from the start (TEI's `truncate`); None refuses a longer input."""
    parameters = Parameters(truncate=truncate)
    if isinstance(value, str):
        return Request(value, parameters, pooling=pooling, model=model)
    return Request("", parameters, pooling=pooling, model=model, input_ids=tuple(value))


def from_rerank_pair(pair: RerankPair, pooling: Pooling, truncate: int | None, model: str | None) -> Request:
    """One (query, document) pair of a rerank request, in the reranker's prompt; `truncate` as above, cutting the
    pair and keeping the prompt's fixed head and tail."""
    text = rerank_prompt(pair.query, pair.document)
    return Request(text, Parameters(truncate=truncate), pooling=pooling, model=model, rerank=pair)
