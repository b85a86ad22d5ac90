"""What the next step of a paged deployment computes: the continuous-batching policy, without any I/O.

There is no prefill phase and no decode phase, only steps (vLLM's view). Each step every running request gets
tokens to compute: one for a decoding request, a chunk of its prompt for one still reading it, within a budget
of `max_batch_prefill_tokens` prompt tokens per step (`prefill_chunk_tokens` while any request is decoding).
Blocks are handed out as sequences grow into them; when none is left the running request with the highest
`priority` value, the newest among equals, is preempted (its blocks freed, back in the queue at its own place,
later recomputed from its prompt and the tokens it had generated), which the oldest requests of the lowest value
never are, so they always progress. Waiting requests join in (priority, arrival) order, only in a step that
preempted nobody, reusing the blocks of their longest cached prefix and reading the rest in chunks.

The planner mutates block tables and the queue as it decides; the scheduler sends the plan to the shards and
advances each sequence's `num_computed_tokens` when the step succeeds. When waiting requests may join, and how much
prompt they may read, is the `--scheduling` policy's answer (`policies/`): continuous, static or sequential.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from conveyor.router.core.block_allocator import BlockAllocator
from conveyor.router.core.draft_choice import DraftChooser, StepCosts
from conveyor.router.core.policies import policy_for
from conveyor.router.core.queue import GroupQueue, Queue
from conveyor.router.core.sequence import Sequence, SequenceStatus
from conveyor.router.pipeline.images import MAX_STEP_PIXEL_BYTES


@dataclass(frozen=True)
class PlannerConfig:
    max_batch_prefill_tokens: int  # prompt tokens read per step, over all requests
    # ...at most this many while some request is decoding: a step's length is every running stream's next
    # inter-token gap, so prompts are read in chunks that keep it near a decode step's.
    prefill_chunk_tokens: int | None = None
    max_batch_size: int | None = None
    scheduling: str = "continuous"  # --scheduling: a name in policies.POLICIES
    static_batch_timeout: float = 1.0  # seconds a static batch waits to fill up
    watermark_blocks: int = 0  # blocks kept free when admitting, so that running requests can grow
    # With nobody waiting to join and every running request decoding, a step may be a run of up to this many
    # decode steps in one call (the shards go from one to the next without waiting for the router).
    max_decode_steps: int = 1
    # Speculative decoding: in a step of decoding sequences only, each may have up to this many draft tokens
    # verified (0: off), while at most `speculate_max_batch` run: a larger batch is compute-bound, and drafts that
    # are rejected then cost real work.
    speculate: int = 0
    speculate_max_batch: int = 4
    # A decode step's seconds by rows, as the shards measured them at warmup: drafts are then offered only where
    # they pay (router/core/draft_choice.py). None: every sequence may have `speculate` drafts.
    step_costs: StepCosts | None = None


@dataclass
class StepPlan:
    """The sequences a step computes; what each computes is on the sequence itself (`step_tokens`,
    `step_new_blocks`)."""

    running: list[Sequence] = field(default_factory=list)  # already in the shards' batch
    admitted: list[Sequence] = field(default_factory=list)  # joining it at this step
    preempted: list[Sequence] = field(default_factory=list)  # to drop from the shards' batch first
    cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    cache_hits: int = 0  # ...and found there
    steps: int = 1  # a decode run's most steps (each running sequence holds blocks for them)

    @property
    def empty(self) -> bool:
        return not self.running and not self.admitted

    @property
    def sequences(self) -> list[Sequence]:
        return [*self.running, *self.admitted]


class StepPlanner:
    """Owns the running set and the blocks it holds. The set is in (priority, arrival) order, which is admission
    order among equals: sequences grow in that order, and the last, the highest priority value and newest among
    equals, is preempted first. When waiting sequences may join is the scheduling policy's to say (`policy`)."""

    def __init__(self, config: PlannerConfig, allocator: BlockAllocator, queue: Queue | GroupQueue) -> None:
        self.config = config
        self.policy = policy_for(config.scheduling, config.max_batch_size, config.static_batch_timeout)
        self.allocator = allocator
        self.queue = queue
        self.running: list[Sequence] = []
        costs = config.step_costs
        self.drafts = DraftChooser(costs) if config.speculate and costs is not None else None

    def plan(self) -> StepPlan:
        plan = StepPlan()
        for sequence in self.running:
            sequence.plan_step(0)
        budget = self._prompt_budget()
        index = 0
        while index < len(self.running):
            sequence = self.running[index]
            if not self._grow(sequence, budget, plan):  # preempted itself: nothing older is left to preempt
                continue
            if sequence.step_tokens:
                plan.running.append(sequence)
            if sequence.is_prefilling:
                budget -= sequence.step_tokens
            index += 1
        if not plan.preempted:
            self._admit(self.policy.newcomer_budget(budget), plan)
            self._add_drafts(plan)
            self._extend_run(plan)
        return plan

    def _add_drafts(self, plan: StepPlan) -> None:
        """Draft budgets for a step of decoding sequences only, few enough to be bound by memory rather than
        compute: each sequence that may speculate may have up to `speculate` (its own `speculate` if lower, and no
        more than its `max_new_tokens` leaves, or its blocks and the free ones hold), of which `drafts` (measured
        step costs against each sequence's acceptance, router/core/draft_choice.py) keeps those that pay; without
        measured costs, all of them. A sequence gets the blocks for its drafts if free ones are left (drafts never
        preempt, and a sequence cut short of blocks drafts fewer)."""
        config = self.config
        if not config.speculate or len(self.running) > config.speculate_max_batch or not _decoding_only(plan):
            return
        limits = [self._draft_limit(s) for s in plan.running]
        if self.drafts is not None:
            limits = self.drafts.choose([s.draft_record for s in plan.running], limits)
        for sequence, drafts in zip(plan.running, limits):
            if drafts <= 0:
                continue
            missing = self.allocator.blocks_for(sequence.num_computed_tokens + 1 + drafts) - len(sequence.block_table)
            blocks = self.allocator.allocate(missing) if missing > 0 else []
            if blocks is None:
                continue  # the shards would find the drafts' slots missing: no drafts rather than a failed step
            sequence.reserve(blocks)
            sequence.step_drafts = drafts

    def _draft_limit(self, sequence: Sequence) -> int:
        if not sequence.may_speculate:
            return 0
        asked = sequence.request.parameters.speculate
        limit = self.config.speculate if asked is None else min(asked, self.config.speculate)
        room = (len(sequence.block_table) + self.allocator.free_blocks) * self.allocator.block_size
        return max(0, min(limit, sequence.draft_room, room - sequence.num_computed_tokens - 1))

    def waiting_to_join(self) -> bool:
        """Whether a waiting request could join at the next step, were there blocks for it: a decode run does
        not start then, and one in progress is cut short."""
        return self.queue.peek() is not None and len(self.running) < self._admission_limit()

    def _extend_run(self, plan: StepPlan) -> None:
        """Makes a plan of decoding sequences only, with nobody waiting to join, a run of up to
        `max_decode_steps`, if the free blocks let every sequence grow that far (a run preempts nobody: it stays
        one step otherwise). A sequence needs blocks for the tokens it will feed before its `max_new_tokens`."""
        limit = self.config.max_decode_steps
        if limit <= 1 or not _decoding_only(plan) or self.waiting_to_join():
            return
        if any(s.step_drafts for s in plan.running):
            return  # a speculating step already makes several tokens
        remaining = {s: max(1, s.tokens_left) for s in plan.running}
        steps = min(limit, max(remaining.values()))
        blocks_for = self.allocator.blocks_for
        missing = {
            s: blocks_for(s.num_computed_tokens + min(steps, remaining[s])) - len(s.block_table) for s in plan.running
        }
        if steps <= 1 or sum(max(0, m) for m in missing.values()) > self.allocator.free_blocks:
            return
        for sequence, count in missing.items():
            if count > 0:
                sequence.reserve(self.allocator.allocate(count) or [])
        plan.steps = steps

    def _prompt_budget(self) -> int:
        config = self.config
        if config.prefill_chunk_tokens and any(not s.is_prefilling for s in self.running):
            return min(config.max_batch_prefill_tokens, config.prefill_chunk_tokens)
        return config.max_batch_prefill_tokens  # nobody is waiting for a token: read as much as allowed

    def next_deadline(self) -> float | None:
        """When the policy stops waiting for more requests (monotonic seconds; a static batch's timeout), if it
        waits."""
        return self.policy.deadline(len(self.running), self.queue)

    # --- running sequences --------------------------------------------------------------------------------

    def _grow(self, sequence: Sequence, budget: int, plan: StepPlan) -> bool:
        """Tokens and blocks for a running sequence; preempts the newest sequences (maybe itself) for blocks.
        False when it preempted itself."""
        done = sequence.num_computed_tokens
        wanted = min(sequence.num_prefill_tokens - done, budget) if sequence.is_prefilling else 1
        if sequence.is_prefilling:
            wanted = sequence.chunk_end(done, done + wanted) - done
        if wanted <= 0:
            return True
        while True:
            tokens = min(wanted, self._room(sequence))
            if tokens < wanted:
                tokens = sequence.chunk_end(done, done + tokens, extend=False) - done
            if tokens > 0 or not self.running:
                break
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is sequence:
                return False
        missing = self.allocator.blocks_for(sequence.num_computed_tokens + tokens) - len(sequence.block_table)
        sequence.plan_step(tokens, (self.allocator.allocate(missing) or []) if missing > 0 else [])
        return True

    def _room(self, sequence: Sequence) -> int:
        """Tokens the sequence can compute with its blocks and every free one."""
        capacity = (len(sequence.block_table) + self.allocator.free_blocks) * self.allocator.block_size
        return capacity - sequence.num_computed_tokens

    def _preempt(self, sequence: Sequence, plan: StepPlan) -> None:
        self.requeue(sequence)
        sequence.num_preemptions += 1
        plan.preempted.append(sequence)

    def requeue(self, sequence: Sequence) -> None:
        """Back in the queue (ahead of those of its priority who came later) holding nothing, to be recomputed
        from its prompt and the tokens it had generated: after a preemption, or after a failed step."""
        if sequence in self.running:
            self.running.remove(sequence)
        self.release(sequence)
        sequence.status = SequenceStatus.WAITING
        self.queue.appendleft(sequence)

    def release(self, sequence: Sequence) -> None:
        """Gives back the sequence's blocks (cached ones stay cached); it then holds nothing."""
        self.allocator.release(sequence.block_table)
        sequence.block_table, sequence.num_cached_blocks = [], 0
        sequence.num_computed_tokens = sequence.num_prefill_tokens = 0
        sequence.plan_step(0)

    # --- admission ----------------------------------------------------------------------------------------

    def _admit(self, budget: int, plan: StepPlan) -> None:
        """Waiting sequences join in order. A suspect (replayed after a failed step) joins alone and nobody joins
        until it has read its tokens back: if the shards die again meanwhile, the blame is its alone, and a
        request that kills the shards every time cannot take the others' retries with it."""
        limit = self._admission_limit()
        whole_budget = budget
        if any(s.suspect for s in self.running):
            return
        while budget > 0 and len(self.running) < limit and (sequence := self.queue.peek()) is not None:
            if sequence.suspect and plan.admitted:
                break
            if (
                plan.admitted
                and sum(s.image_bytes for s in plan.admitted) + sequence.image_bytes > MAX_STEP_PIXEL_BYTES
            ):
                break  # the step's message would carry too many images' pixels: it joins the next step
            if not self._start(sequence, budget, first=budget == whole_budget, plan=plan):
                break
            self.queue.popleft()
            sequence.status = SequenceStatus.RUNNING
            bisect.insort(self.running, sequence, key=lambda s: s.order)
            plan.admitted.append(sequence)
            budget -= sequence.step_tokens
            if sequence.suspect:
                break

    def _admission_limit(self) -> int:
        """How many sequences may be running once this step's newcomers joined."""
        return self.policy.batch_limit(len(self.running), self.queue)

    def _start(self, sequence: Sequence, budget: int, first: bool, plan: StepPlan) -> bool:
        """The first chunk of a waiting sequence, after its cached prefix; False (nothing held) if it must wait."""
        tokens = sequence.cache_tokens
        size = self.allocator.block_size
        whole = sequence.request.parameters.decoder_input_details and not sequence.generated_ids
        pooling = sequence.request.pooling
        fresh = whole or (pooling is not None and pooling.every_position)  # every position computed, none cached
        matched = [] if fresh else self.allocator.match(tokens, (len(tokens) - 1) // size, sequence.cache_scope)
        cache_len = len(matched) * size
        chunk = sequence.chunk_end(cache_len, cache_len + min(len(tokens) - cache_len, budget)) - cache_len
        if chunk < len(tokens) - cache_len and not first:
            # Only a step's first prompt starts in part. A later one read in part would lengthen this step, and so
            # the first token of every prompt the step ends, without giving its own first token any sooner: it waits
            # for a step that reads it first (prompt logprobs, which need the whole prompt in one step, likewise).
            self.allocator.release(matched)
            return False
        if whole:
            chunk = len(tokens)
        needed = self.allocator.blocks_for(cache_len + chunk) - len(matched)
        reserve = self.config.watermark_blocks if self.running else 0
        blocks = self.allocator.allocate(needed) if self.allocator.free_blocks - needed >= reserve else None
        if blocks is None:
            self.allocator.release(matched)
            return False
        sequence.block_table, sequence.num_cached_blocks = matched, len(matched)  # matched blocks are cached already
        sequence.num_computed_tokens, sequence.num_prefill_tokens = cache_len, len(tokens)
        if not sequence.generated_ids:  # the read that will give its first token: what usage reports
            sequence.cached_prompt_tokens = cache_len
        sequence.plan_step(chunk, blocks)
        plan.cache_queries += len(tokens)
        plan.cache_hits += cache_len
        return True

    # --- after a step -------------------------------------------------------------------------------------

    def advance(self, plan: StepPlan, generated: dict[int, int] | None = None) -> None:
        """The step ran: each sequence's computed tokens move on, and its full blocks enter the prefix cache.
        `generated`: tokens each sequence got at the step (its generated tokens must be recorded first). A sequence
        that drafted computed its next token and the drafts accepted, which is as many as it got; its blocks past
        what its next token needs go back, as the shards cut their copy of its block table by the same rule."""
        for sequence in plan.sequences:
            if not sequence.step_drafts:
                self.advance_sequence(sequence, sequence.step_tokens)
                continue
            self.advance_sequence(sequence, (generated or {}).get(sequence.id, 1))
            keep = self.allocator.blocks_for(sequence.num_computed_tokens + 1)
            self.allocator.release(sequence.block_table[keep:])
            del sequence.block_table[keep:]

    def advance_sequence(self, sequence: Sequence, tokens: int) -> None:
        """`tokens` more of the sequence's KV are computed (one per step of a decode run)."""
        size = self.allocator.block_size
        sequence.num_computed_tokens += tokens
        sequence.suspect = sequence.suspect and sequence.is_prefilling
        full = sequence.num_computed_tokens // size
        if full > sequence.num_cached_blocks:
            # Past a conflict (the same content cached in another block) insert stops; trying again at
            # every step would only stop there again, so the count moves on either way.
            self.allocator.insert(
                sequence.cache_tokens[: full * size], sequence.block_table[:full], sequence.cache_scope
            )
            sequence.num_cached_blocks = full

    def remove(self, sequence: Sequence) -> None:
        """A sequence left the batch (finished, cancelled or failed): its blocks go back."""
        if sequence in self.running:
            self.running.remove(sequence)
        self.release(sequence)


def _decoding_only(plan: StepPlan) -> bool:
    """A step in which every sequence decodes: nobody joins and no prompt is being read (runs and drafts only)."""
    return not plan.admitted and bool(plan.running) and not any(s.is_prefilling for s in plan.running)
