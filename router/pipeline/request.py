"""The one internal request every front door's types become, and the one mapping from each API's types to it.

TGI's names are the router's: `from_tgi` is nearly a copy. OpenAI's routes differ in a few places, all here:
`temperature: 0` is greedy, `max_tokens` (or `max_completion_tokens`) is `max_new_tokens`, `logprobs` /
`top_logprobs` are `top_n_tokens`, and the constraint comes from whichever structured-output field carries one.
The sampling fields both APIs share (`SharedSampling`) are copied by name, so a field added to the schema needs
nothing here. Which fields Conveyor refuses is declared in the schemas (`refused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from conveyor.grammar import Constraint
from conveyor.router.api.openai import OpenAIRequest
from conveyor.router.api.tgi import WARPERS, GenerateParameters, Sampling, SharedSampling


@dataclass(frozen=True)
class Parameters:
    """A request's parameters as every API's request becomes them (`from_tgi`, `from_openai`), under TGI's names."""

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

    @property
    def seed(self) -> int | None:
        """Filled by validation when sampling and not given; None for greedy."""
        return self.sampling.seed


@dataclass(frozen=True)
class ValidRequest:
    inputs: str
    input_ids: tuple[int, ...]
    parameters: Parameters


_UNSET = Sampling()


def sampling_of(values: BaseModel, names: Any, **more: Any) -> Sampling:
    """The `Sampling` fields of `values` among `names`, and `more`, marked as given (a model's
    generation_config.json fills only what a request leaves unset)."""
    given = {name: getattr(values, name) for name in Sampling.model_fields if name in names} | more
    return _UNSET.model_copy(update=given)  # what pydantic does fastest with values already checked


def from_tgi(p: GenerateParameters) -> Parameters:
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
    )


def from_openai(
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
