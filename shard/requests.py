"""Per-request state a shard keeps across steps, whatever engine holds the request's KV."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.shard.detokenize import IncrementalDetokenizer
from conveyor.shard.sampling import SamplingParams
from conveyor.shard.stopping import FinishReason, StoppingCriteria
from conveyor.v1 import shard_pb2 as pb


class BadRequest(ValueError):
    """The router asked for something this shard cannot do: answered INVALID_ARGUMENT, the shard serves on."""


@dataclass
class RequestState:
    """What survives between steps for one request: its tokens, its text so far and why it may stop."""

    id: int
    input_ids: list[int]
    params: SamplingParams
    stopping: StoppingCriteria
    detokenizer: IncrementalDetokenizer
    prefill_logprobs: bool
    top_n_tokens: int = 0  # alternatives to report with each token
    generated_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_pb(
        cls, request: pb.Request, tokenizer, eos_token_ids: frozenset[int], vocab_size: int
    ) -> "RequestState":
        stop = request.stopping_parameters
        input_ids = list(request.input_ids)
        if not input_ids:
            raise BadRequest(f"request {request.id} has no input tokens")
        if max(input_ids) >= vocab_size:
            raise BadRequest(f"request {request.id} has token ids outside the vocabulary (size {vocab_size})")
        resumed = request.resumed_tokens
        if resumed >= len(input_ids) or resumed >= max(1, stop.max_new_tokens):
            raise BadRequest(f"request {request.id} resumes {resumed} tokens of {len(input_ids)} inputs")
        prompt_ids = input_ids[: len(input_ids) - resumed]
        state = cls(
            id=request.id,
            input_ids=input_ids,
            params=SamplingParams.from_pb(request.parameters),
            stopping=StoppingCriteria(
                eos_token_ids=eos_token_ids,
                max_new_tokens=max(1, stop.max_new_tokens),
                stop_sequences=list(stop.stop_sequences),
                ignore_eos=stop.ignore_eos_token,
            ),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids),
            prefill_logprobs=request.prefill_logprobs,
            top_n_tokens=request.top_n_tokens,
        )
        for token_id in input_ids[len(prompt_ids) :]:
            state.replay(token_id)
        return state

    def replay(self, token_id: int) -> None:
        """Re-records a token generated before a preemption: the text, the stop check and the count go on from
        where they were, and nothing is sent again (the router already streamed it)."""
        self.generated_ids.append(token_id)
        self.detokenizer.step(token_id)
        self.stopping(token_id, self.detokenizer.text)

    @property
    def remaining_tokens(self) -> int:
        return self.stopping.max_new_tokens - len(self.generated_ids)

    def step(self, token_id: int, logprob: float, tokenizer, special_ids: frozenset[int]) -> pb.Generation:
        """Records one generated token and returns the Generation the router streams for it."""
        self.generated_ids.append(token_id)
        text = self.detokenizer.step(token_id)
        reason = self.stopping(token_id, self.detokenizer.text)
        generation = pb.Generation(
            request_id=self.id,
            tokens=pb.Tokens(
                ids=[token_id], logprobs=[logprob], texts=[text], is_special=[token_id in special_ids]
            ),
        )
        if reason is not None:
            generation.finished.CopyFrom(self._finished(reason))
        return generation

    def _finished(self, reason: FinishReason) -> pb.GeneratedText:
        finished = pb.GeneratedText(
            text=self.detokenizer.text,
            generated_tokens=len(self.generated_ids),
            finish_reason=int(reason),
        )
        if self.params.sampling:
            finished.seed = self.params.seed
        return finished


def rows_of(requests: list[RequestState], request_ids: list[int], batch_id: int) -> list[int]:
    """The rows of `requests` holding `request_ids`, in that order; KeyError names any the batch lacks."""
    index = {r.id: i for i, r in enumerate(requests)}
    missing = [i for i in request_ids if i not in index]
    if missing:
        raise KeyError(f"batch {batch_id} has no requests {missing}")
    return [index[i] for i in request_ids]


def prefill_tokens_pb(input_ids: list[int], logprobs: list[float], tokenizer) -> pb.Tokens:
    """The prompt tokens with the log-probability the model gave each; the first has none (NaN)."""
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in input_ids]
    special = set(tokenizer.all_special_ids)
    return pb.Tokens(
        ids=input_ids,
        logprobs=[math.nan, *logprobs],
        texts=texts,
        is_special=[i in special for i in input_ids],
    )
