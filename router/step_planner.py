"""What the next step of a paged deployment computes: the continuous-batching policy, without any I/O.

There is no prefill phase and no decode phase, only steps (vLLM's view). Each step every running request gets
tokens to compute: one for a decoding request, a chunk of its prompt for one still reading it, within a budget
of `max_batch_prefill_tokens` prompt tokens per step (`prefill_chunk_tokens` while any request is decoding).
Blocks are handed out as sequences grow into them; when none is left the newest running request is preempted (its blocks freed, back to the front of the queue, later
recomputed from its prompt and the tokens it had generated), which the oldest requests never are, so they
always progress. Waiting requests join only in a step that preempted nobody, reusing the blocks of their
longest cached prefix and reading the rest in chunks.

The planner mutates block tables and the queue as it decides; the scheduler sends the plan to the shards and
advances each request's `computed` count when the step succeeds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from conveyor.router.block_allocator import BlockAllocator
from conveyor.router.queue import Entry, Queue

DEFAULT_STATIC_BATCH_SIZE = 32


class Scheduling(str, Enum):
    CONTINUOUS = "continuous"  # join and leave at every step
    STATIC = "static"  # wait for a full batch (or a timeout), run it to completion, admit nothing meanwhile
    SEQUENTIAL = "sequential"  # one request at a time


@dataclass(frozen=True)
class PlannerConfig:
    max_batch_prefill_tokens: int  # prompt tokens read per step, over all requests
    # ...at most this many while some request is decoding: a step's length is every running stream's next
    # inter-token gap, so prompts are read in chunks that keep it near a decode step's.
    prefill_chunk_tokens: int | None = None
    max_batch_size: int | None = None
    scheduling: Scheduling = Scheduling.CONTINUOUS
    static_batch_timeout: float = 1.0  # seconds a static batch waits to fill up
    watermark_blocks: int = 0  # blocks kept free when admitting, so that running requests can grow


@dataclass
class Work:
    entry: Entry
    tokens: int  # tokens computed for this request at this step
    new_blocks: list[int] = field(default_factory=list)  # appended to its block table at this step
    cache_len: int = 0  # admitted now: prompt tokens found in the prefix cache


@dataclass
class StepPlan:
    running: list[Work] = field(default_factory=list)  # requests already in the shards' batch
    admitted: list[Work] = field(default_factory=list)  # requests joining it at this step
    preempted: list[Entry] = field(default_factory=list)  # requests to drop from the shards' batch first
    cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    cache_hits: int = 0  # ...and found there

    @property
    def empty(self) -> bool:
        return not self.running and not self.admitted


class StepPlanner:
    def __init__(self, config: PlannerConfig, allocator: BlockAllocator, queue: Queue) -> None:
        self.config = config
        self.allocator = allocator
        self.queue = queue
        self.running: list[Entry] = []  # in admission order: the newest is preempted first

    def plan(self) -> StepPlan:
        plan = StepPlan()
        budget = self._prompt_budget()
        index = 0
        while index < len(self.running):
            entry = self.running[index]
            work = self._grow(entry, budget, plan)
            if work is None:  # preempted itself: nothing older is left to preempt
                continue
            if work.tokens:
                plan.running.append(work)
            if entry.prefilling:
                budget -= work.tokens
            index += 1
        if not plan.preempted:
            if self.config.scheduling is Scheduling.STATIC:
                budget = 1 << 30  # a static batch reads all its prompts at once, as a padded batch would
            self._admit(budget, plan)
        return plan

    def _prompt_budget(self) -> int:
        config = self.config
        if config.prefill_chunk_tokens and any(not e.prefilling for e in self.running):
            return min(config.max_batch_prefill_tokens, config.prefill_chunk_tokens)
        return config.max_batch_prefill_tokens  # nobody is waiting for a token: read as much as allowed

    def next_deadline(self) -> float | None:
        """When a static batch stops waiting to fill up (monotonic seconds), if one is waiting."""
        if self.config.scheduling is not Scheduling.STATIC or self.running or (first := self.queue.peek()) is None:
            return None
        return first.queued_at + self.config.static_batch_timeout

    # --- running requests ---------------------------------------------------------------------------------

    def _grow(self, entry: Entry, budget: int, plan: StepPlan) -> Work | None:
        """Tokens and blocks for a running request; preempts the newest requests (maybe itself) for blocks."""
        wanted = min(entry.target - entry.computed, budget) if entry.prefilling else 1
        if wanted <= 0:
            return Work(entry, 0)
        while True:
            tokens = min(wanted, self._room(entry))
            if tokens > 0 or not self.running:
                break
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is entry:
                return None
        work = Work(entry, tokens)
        missing = self.allocator.blocks_for(entry.computed + tokens) - len(entry.blocks)
        if missing > 0:
            work.new_blocks = self.allocator.allocate(missing) or []
            entry.blocks.extend(work.new_blocks)
        return work

    def _room(self, entry: Entry) -> int:
        """Tokens the request can compute with its blocks and every free one."""
        capacity = (len(entry.blocks) + self.allocator.free_blocks) * self.allocator.block_size
        return capacity - entry.computed

    def _preempt(self, entry: Entry, plan: StepPlan) -> None:
        self.release(entry)
        entry.preemptions += 1
        plan.preempted.append(entry)
        self.queue.appendleft(entry)

    def release(self, entry: Entry) -> None:
        """Gives back the request's blocks (cached ones stay cached); it then holds nothing."""
        self.allocator.release(entry.blocks)
        entry.blocks, entry.cached_blocks, entry.computed, entry.target = [], 0, 0, 0

    # --- admission ----------------------------------------------------------------------------------------

    def _admit(self, budget: int, plan: StepPlan) -> None:
        limit = self._admission_limit()
        whole_budget = budget
        while budget > 0 and len(self.running) < limit and (entry := self.queue.peek()) is not None:
            work = self._start(entry, budget, first=budget == whole_budget, plan=plan)
            if work is None:
                break
            self.queue.popleft()
            self.running.append(entry)
            plan.admitted.append(work)
            budget -= work.tokens

    def _admission_limit(self) -> int:
        """How many requests may be running once this step's newcomers joined."""
        config, running = self.config, len(self.running)
        if config.scheduling is Scheduling.SEQUENTIAL:
            return 0 if running else 1
        if config.scheduling is Scheduling.STATIC:
            size = config.max_batch_size or DEFAULT_STATIC_BATCH_SIZE
            if running:
                return 0
            deadline = self.next_deadline()
            full = len(self.queue) >= size
            return size if full or (deadline is not None and time.monotonic() >= deadline) else 0
        return config.max_batch_size or 1 << 30

    def _start(self, entry: Entry, budget: int, first: bool, plan: StepPlan) -> Work | None:
        """The first chunk of a waiting request, after its cached prefix; None (nothing held) if it must wait."""
        tokens = entry.tokens
        whole = entry.request.parameters.decoder_input_details and not entry.generated_ids
        matched = [] if whole else self.allocator.match(tokens, (len(tokens) - 1) // self.allocator.block_size)
        cache_len = len(matched) * self.allocator.block_size
        chunk = min(len(tokens) - cache_len, budget)
        if whole and chunk < len(tokens) and not first:
            return None  # prompt logprobs need the whole prompt in one step: wait for a step of its own
        if whole:
            chunk = len(tokens)
        needed = self.allocator.blocks_for(cache_len + chunk) - len(matched)
        reserve = self.config.watermark_blocks if self.running else 0
        blocks = self.allocator.allocate(needed) if self.allocator.free_blocks - needed >= reserve else None
        if blocks is None:
            self.allocator.release(matched)
            return None
        entry.blocks, entry.cached_blocks = [*matched, *blocks], len(matched)  # matched blocks are cached already
        entry.computed, entry.target = cache_len, len(tokens)
        plan.cache_queries += len(tokens)
        plan.cache_hits += cache_len
        return Work(entry, chunk, cache_len=cache_len)

    # --- after a step -------------------------------------------------------------------------------------

    def advance(self, plan: StepPlan) -> None:
        """The step ran: each request's computed tokens move on, and its full blocks enter the prefix cache."""
        size = self.allocator.block_size
        for work in (*plan.running, *plan.admitted):
            entry = work.entry
            entry.computed += work.tokens
            full = entry.computed // size
            if full > entry.cached_blocks:
                # Past a conflict (the same content cached in another block) insert stops; trying again at
                # every step would only stop there again, so the count moves on either way.
                self.allocator.insert(entry.tokens[: full * size], entry.blocks[:full])
                entry.cached_blocks = full

    def remove(self, entry: Entry) -> None:
        """A request left the batch (finished, cancelled or failed): its blocks go back."""
        if entry in self.running:
            self.running.remove(entry)
        self.release(entry)
