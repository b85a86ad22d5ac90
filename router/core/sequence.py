"""One request's whole life in the router, in one record: nano-vllm's `Sequence`.

The queue holds it while it waits, the step planner while it runs (its block table and how far its KV has got),
the loop streams its tokens to `events`; nothing else keeps per-request state.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from enum import Enum

from opentelemetry.trace import Span

from conveyor import allowance
from conveyor.keys import ANONYMOUS, ApiKey
from conveyor.router.core.draft_choice import DraftRecord
from conveyor.router.core.events import ErrorEvent, Event
from conveyor.router.pipeline.request import ValidRequest


class SequenceStatus(Enum):
    WAITING = "waiting"  # in the queue: new, or preempted and waiting to be recomputed
    RUNNING = "running"  # in the shards' batch
    FINISHED = "finished"  # its last event (final token or error) is sent


@dataclass(frozen=True)
class CacheScope:
    """Whose cached KV blocks a request may share, as separate fields: compared field by field, so no salt or key
    name, whatever characters it holds, can spell another scope (a scope joined into one string could: the salt
    `s|adapter:sql` on the base model once read another key's adapter-`sql` blocks as its own)."""

    owner: str  # "salt" (the request's cache_salt) or "key" (its API key's name)
    name: str
    adapter: str | None = None  # an adapter's KV is not the base model's, nor another adapter's

    def digest(self) -> str:
        """The scope as the shards get it (shard/kv_offload/prefix_offload.py keys disk blocks by it): one-way, so
        that no key name or salt travels or lands in a file name, and field by field, as the comparison is."""
        h = hashlib.sha256()
        for part in (self.owner, self.name, self.adapter or ""):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()


@dataclass(eq=False)
class Sequence:
    id: int
    request: ValidRequest
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    key: ApiKey = ANONYMOUS  # who made it: its share of the queue, and who may see and cancel it
    request_id: str = ""  # the caller's name for it (X-Request-Id), by which it is listed and cancelled
    group: int = 0  # the shard group it is placed on (router/core/placement.py); 0 with one group
    status: SequenceStatus = SequenceStatus.WAITING
    # Set by the front door when the client goes away; the loop drops the sequence at its next step.
    cancelled: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    batched_at: float | None = None  # first admission (a preempted sequence keeps it)
    # Tokens generated so far, as streamed: a preempted sequence is recomputed from its prompt and these.
    generated_ids: list[int] = field(default_factory=list)

    # KV, from admission until the sequence leaves the batch.
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading full blocks matched in, or offered to, the prefix cache
    num_computed_tokens: int = 0  # tokens whose KV is on the shards
    num_prefill_tokens: int = (
        0  # tokens to read before it samples: its prompt, plus what it had generated when preempted
    )
    num_preemptions: int = 0
    # Prompt tokens whose KV the read of its prompt that gave its first token took from the prefix cache (the
    # router's blocks, then the shards' disk tier) instead of computing: each API's usage reports them (OpenAI's
    # cached_tokens), so a caller sees what its cache hits saved. A read after a preemption leaves it as it was.
    cached_prompt_tokens: int = 0
    # Crash recovery: how many failed steps were blamed on it, and whether it was replayed after one and has
    # not yet read its tokens back through a step that succeeded (it then runs beside no other suspect).
    num_replays: int = 0
    suspect: bool = False

    # This step, as the planner decided it; the loop applies it once the shards ran the step.
    step_tokens: int = 0  # tokens computed at this step: 1 when decoding, a prompt chunk when prefilling
    step_new_blocks: list[int] = field(default_factory=list)  # appended to the block table at this step
    step_drafts: int = 0  # decoding: the most draft tokens the shards may verify at this step (its blocks hold them)

    # Speculative decoding, over its whole life: draft tokens verified, and accepted; and its recent acceptance,
    # which sets how many it is offered (router/core/draft_choice.py).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_record: DraftRecord = field(default_factory=DraftRecord)

    # Tracing: the span of the call that made this request, and the one timing its wait in the queue.
    span: Span | None = None
    queue_span: Span | None = None

    @property
    def priority(self) -> int:
        return self.request.parameters.priority

    @property
    def order(self) -> tuple[int, int]:
        """Its place in the running set: the lowest priority value first (vLLM's convention), then the earliest
        arrival (ids are handed out as requests arrive)."""
        return (self.priority, self.id)

    @property
    def cache_scope(self) -> CacheScope:
        """Whose cached prompt blocks it may reuse and offer: its salt's, else its key's, under its adapter. Sharing
        across keys would let one tenant confirm a guess of another's prompt by its time to first token or the
        cache-hit count; across adapters, a prefix's KV differs."""
        salt = self.request.parameters.cache_salt
        owner = ("salt", salt) if salt is not None else ("key", self.key.name)
        return CacheScope(*owner, adapter=self.request.parameters.adapter)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.request.parameters.max_new_tokens

    @property
    def tokens_left(self) -> int:
        return allowance.tokens_left(self.max_new_tokens, len(self.generated_ids))

    @property
    def draft_room(self) -> int:
        return allowance.draft_room(self.max_new_tokens, len(self.generated_ids))

    @property
    def token_ids(self) -> list[int]:
        """Every token whose KV the sequence may need: its prompt and what it has generated."""
        return [*self.request.input_ids, *self.generated_ids]

    @property
    def cache_tokens(self) -> list[int]:
        """`token_ids` as the prefix cache keys them: each image's soft tokens (one id for every image) as the
        negative of its pixels' digest, so that blocks holding two different images never match, and two requests
        with the same image (and the same tokens before it) share them."""
        tokens = self.token_ids
        for image in self.request.parameters.images:
            key = -1 - int.from_bytes(image.digest, "big")
            tokens[image.offset : image.offset + image.length] = [key] * image.length
        return tokens

    @property
    def image_bytes(self) -> int:
        """The pixel values its joining message carries to the shards."""
        return sum(len(image.pixel_values) for image in self.request.parameters.images)

    def chunk_end(self, start: int, end: int, extend: bool = True) -> int:
        """Where a prompt chunk [start, end) may end: never inside an image's soft tokens, which attend to each
        other both ways and so are read in one chunk. Before the image if the chunk has tokens before it (or if not
        `extend`), else after the image, past `end`."""
        for image in self.request.parameters.images:
            if image.offset < end < image.offset + image.length:
                return image.offset if image.offset > start or not extend else image.offset + image.length
        return end

    @property
    def may_speculate(self) -> bool:
        """Drafts are verified by sampling each position as a plain step would; penalties (which count the tokens
        of the step before) and grammars (whose matcher would have to roll back) are not drafted for."""
        p = self.request.parameters
        s = p.sampling
        penalised = s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
        return p.speculate != 0 and p.grammar is None and not penalised

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fail(self, message: str, error_type: str = "generation") -> None:
        """Ends it with an error event: its stream's last."""
        self.status = SequenceStatus.FINISHED
        self.events.put_nowait(ErrorEvent(message, error_type))

    def plan_step(self, tokens: int, new_blocks: list[int] = ()) -> None:
        self.step_tokens = tokens
        self.step_new_blocks = []
        self.step_drafts = 0
        self.reserve(new_blocks)

    def reserve(self, blocks: list[int]) -> None:
        """More blocks at this step: the shards learn of them with the step."""
        self.step_new_blocks.extend(blocks)
        self.block_table.extend(blocks)
