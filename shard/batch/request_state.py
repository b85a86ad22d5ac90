"""Per-request state a shard keeps across steps: its tokens, its text so far, why it may stop, and where its KV is."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from conveyor import allowance
from conveyor.grammar import GrammarCache, GrammarError
from conveyor.shard.batch.detokenize import IncrementalDetokenizer
from conveyor.shard.batch.prompt_images import ImageError, PromptImage
from conveyor.shard.batch.prompt_pooling import PoolingError, PromptPooling
from conveyor.shard.batch.stopping import FinishReason, StoppingCriteria
from conveyor.shard.sampling.sampler import SamplingParams
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """The router asked for something this shard cannot do: answered INVALID_ARGUMENT, the shard serves on."""


@dataclass
class RequestState:
    """What survives between steps for one request. A request *prefills* (reads its prompt, maybe in chunks the
    router sets at each step) until the chunk that ends its prompt samples its first token; from then on it
    *decodes*, feeding `next_token` at each step."""

    id: int
    input_ids: list[int]
    params: SamplingParams
    stopping: StoppingCriteria
    detokenizer: IncrementalDetokenizer
    prefill_logprobs: bool
    top_n_tokens: int = 0  # alternatives to report with each token
    generated_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # its KV blocks, as the router allocated them
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    chunk_len: int = 0  # prefilling: prompt tokens to read at the next step (0: none)
    next_token: int | None = None  # decoding: the token fed at the next step
    matcher: Any = None  # a constrained request's llguidance matcher, advanced by every token it generates
    resumed_tokens: int = 0  # the last input_ids a resumed request had generated before its preemption
    speculate: int = 0  # decoding: the most draft tokens to verify at the next step (the router sets it each step)
    drafts: list[int] = field(default_factory=list)  # decoding: this step's draft tokens, fed after next_token
    draft_len: int = 0  # tokens whose KV the draft model has (shard/speculation/draft_model.py)
    adapter: str = ""  # the LoRA adapter its tokens go through ("": the base model)
    cache_scope: str = (
        ""  # whose blocks it may share, as the router's digest (kv_offload/prefix_offload.py keys disk blocks by it)
    )
    offload_keys: list[bytes] = field(default_factory=list)  # its full blocks' disk keys, computed as needed
    disk_cached_tokens: int = 0  # prompt tokens read from the disk tier, told with its first token (usage)
    pooling: PromptPooling | None = None  # a prompt-only request (embeddings, rerank): it never decodes
    images: list[PromptImage] = field(default_factory=list)  # the images among its prompt's tokens

    @property
    def is_decoding(self) -> bool:
        return self.next_token is not None

    @property
    def computes_every_prompt_token(self) -> bool:
        """Whether no cached KV may stand in for any of its prompt: its prompt's log-probabilities, or a pooling
        over every position, need each position computed here."""
        return self.prefill_logprobs or (self.pooling is not None and self.pooling.every_position)

    @classmethod
    def from_pb(
        cls, request: pb.Request, tokenizer, eos_token_ids: frozenset[int], vocab_size: int, grammars: GrammarCache
    ) -> RequestState:
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
                # A constrained request ends where its grammar does (`step`), not at every EOS id: llguidance reads
                # an EOS id that is an ordinary token (the test model's " >=") as text where the grammar cannot end,
                # as inside a JSON string, and ending there would cut the JSON short.
                ignore_eos=stop.ignore_eos_token or bool(request.grammar),
            ),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids),
            prefill_logprobs=request.prefill_logprobs,
            top_n_tokens=request.top_n_tokens,
            block_table=list(request.blocks),
            resumed_tokens=resumed,
            adapter=request.adapter,
            cache_scope=request.cache_scope,
        )
        if request.HasField("pooling"):
            state.pooling = _pooling(request)
        try:
            state.images = [PromptImage.from_pb(image, len(prompt_ids)) for image in request.images]
        except ImageError as exc:
            raise BadRequest(f"request {request.id}: {exc}") from None
        if request.grammar:
            try:
                state.matcher = grammars.matcher(request.grammar)
            except GrammarError as exc:
                raise BadRequest(f"request {request.id}: {exc}") from None
        state._start_prefill(request.cache_len, request.chunk_len if request.HasField("chunk_len") else None)
        for token_id in input_ids[len(prompt_ids) :]:
            state.replay(token_id)
        return state

    def _start_prefill(self, cache_len: int, chunk_len: int | None) -> None:
        """From its cached prefix on, reading `chunk_len` (or all the rest) at its first step."""
        prompt = len(self.input_ids)
        chunk = prompt - cache_len if chunk_len is None else chunk_len
        if not 0 <= cache_len < prompt or not 0 < chunk <= prompt - cache_len:
            raise BadRequest(
                f"request {self.id}: cache_len {cache_len} and chunk_len {chunk} do not fit its {prompt} input tokens"
            )
        if self.prefill_logprobs and (cache_len or chunk < prompt):
            raise BadRequest(f"request {self.id}: prompt logprobs need the whole prompt in one chunk")
        self.num_computed_tokens, self.chunk_len = cache_len, chunk

    def update(self, update: pb.RequestUpdate) -> None:
        """Grows the block table and sets this step's prompt chunk or draft budget."""
        self.block_table.extend(update.new_blocks)
        if update.speculate:
            if not self.is_decoding or self.matcher is not None:
                raise BadRequest(f"request {self.id} cannot speculate: it is reading its prompt or constrained")
            self.speculate = update.speculate
        if not update.chunk_len:
            return
        if self.is_decoding:
            raise BadRequest(f"request {self.id} has read its prompt: no chunk to give it")
        if self.num_computed_tokens + update.chunk_len > len(self.input_ids):
            raise BadRequest(f"request {self.id}: chunk_len {update.chunk_len} runs past its prompt")
        self.chunk_len = update.chunk_len

    def step_tokens(self) -> list[int]:
        """The tokens this step feeds: the next token when decoding, else the prompt chunk (maybe none)."""
        if self.is_decoding:
            return [self.next_token, *self.drafts]
        start = self.num_computed_tokens
        return self.input_ids[start : start + self.chunk_len]

    def replay(self, token_id: int) -> None:
        """Re-records a token generated before a preemption: the text, the stop check, the grammar and the count go
        on from where they were, and nothing is sent again (the router already streamed it)."""
        self.generated_ids.append(token_id)
        self.detokenizer.step(token_id)
        self.stopping(token_id, self.detokenizer.text)
        self._advance_grammar(token_id)

    def _advance_grammar(self, token_id: int) -> bool:
        """Feeds the token to the matcher; True when the grammar is complete (nothing may follow) or has failed
        (a token it refused: llguidance then allows only EOS). An EOS id completes it only where it may end."""
        if self.matcher is None:
            return False
        if not self.matcher.consume_token(token_id):
            log.warning("grammar refused a token", extra={"request": self.id, "error": self.matcher.get_error()})
        return self.matcher.is_stopped()

    @property
    def token_ids(self) -> list[int]:
        """Its whole text as tokens: the prompt, then every token generated (a resumed request's prompt ends with
        the tokens it had generated, which `generated_ids` holds too)."""
        return self.input_ids[: len(self.input_ids) - self.resumed_tokens] + self.generated_ids

    @property
    def draft_room(self) -> int:
        return allowance.draft_room(self.stopping.max_new_tokens, len(self.generated_ids))

    def step(self, token_id: int, logprob: float, tokenizer, special_ids: frozenset[int]) -> pb.Generation:
        """Records one generated token and returns the Generation the router streams for it."""
        self.generated_ids.append(token_id)
        text = self.detokenizer.step(token_id)
        reason = self.stopping(token_id, self.detokenizer.text)
        if self._advance_grammar(token_id) and reason in (None, FinishReason.LENGTH):
            reason = FinishReason.EOS_TOKEN  # a complete grammar ends the text as EOS would
        generation = pb.Generation(
            request_id=self.id,
            tokens=pb.Tokens(ids=[token_id], logprobs=[logprob], texts=[text], is_special=[token_id in special_ids]),
        )
        if reason is not None:
            # The special token that ended the text is not part of it (TGI's generated_text skips it too); its own
            # text still goes with the token, marked special.
            final = self.detokenizer.text
            if reason == FinishReason.EOS_TOKEN and token_id in special_ids and text and final.endswith(text):
                final = final[: -len(text)]
            generation.finished.CopyFrom(self._finished(reason, final))
        return generation

    def _finished(self, reason: FinishReason, text: str) -> pb.GeneratedText:
        finished = pb.GeneratedText(
            text=text,
            generated_tokens=len(self.generated_ids),
            finish_reason=int(reason),
        )
        if self.params.sampling:
            finished.seed = self.params.seed
        return finished


def _pooling(request: pb.Request) -> PromptPooling:
    """A prompt-only request's pooling; one that could not be served as asked is refused."""
    try:
        pooling = PromptPooling.from_pb(request.pooling)
    except PoolingError as exc:
        raise BadRequest(f"request {request.id}: {exc}") from None
    if request.grammar or request.prefill_logprobs or request.resumed_tokens:
        raise BadRequest(f"request {request.id}: a prompt-only request has no grammar, prompt logprobs or tokens")
    if pooling.every_position and request.cache_len:
        raise BadRequest(f"request {request.id}: {pooling.mode} pooling needs its whole prompt computed (cache_len 0)")
    return pooling
