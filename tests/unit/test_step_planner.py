"""The step planner (continuous batching, chunked prefill, preemption, prefix caching), driven without processes
or a model: the tests play the scheduler's part themselves, one simulated step at a time."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from conveyor.config import SCHEDULING
from conveyor.router.core.block_allocator import BlockAllocator
from conveyor.router.core.draft_choice import StepCosts
from conveyor.router.core.policies import POLICIES, Continuous, policy_for, static
from conveyor.router.core.queue import Queue
from conveyor.router.core.sequence import Sequence, SequenceStatus
from conveyor.router.core.step_planner import PlannerConfig, StepPlan, StepPlanner
from conveyor.router.pipeline.request import Parameters, ValidRequest


def make_sequence(
    n: int,
    prompt: list[int] | int,
    max_new_tokens: int = 10,
    decoder_input_details: bool = False,
    queued_at: float | None = None,
    priority: int = 0,
) -> Sequence:
    """A request whose prompt is `prompt` (or, given a length, tokens unique to this request)."""
    ids = tuple(range(n * 10_000, n * 10_000 + prompt)) if isinstance(prompt, int) else tuple(prompt)
    request = ValidRequest(
        inputs="x" * len(ids),
        input_ids=ids,
        parameters=Parameters(
            max_new_tokens=max_new_tokens, decoder_input_details=decoder_input_details, priority=priority
        ),
    )
    sequence = Sequence(id=n, request=request)
    if queued_at is not None:
        sequence.queued_at = queued_at
    return sequence


@dataclass(frozen=True)
class Planned:
    """What a plan set on a sequence for one step, read right after `plan()`: kept because a sequence that
    finishes at the step gives it all back (`remove` clears its step and its block table)."""

    tokens: int  # step_tokens
    new_blocks: list[int]  # step_new_blocks
    cache_len: int  # num_computed_tokens before the step: for a newcomer, its prefix-cache hit
    block_table: list[int]
    num_prefill_tokens: int

    @classmethod
    def of(cls, s: Sequence) -> Planned:
        return cls(
            s.step_tokens, list(s.step_new_blocks), s.num_computed_tokens, list(s.block_table), s.num_prefill_tokens
        )


class Sim:
    """The planner with a pool and a queue, and the scheduler's side of a step."""

    def __init__(
        self,
        max_batch_prefill_tokens: int = 1000,
        num_blocks: int = 1000,
        block_size: int = 16,
        prefix_caching: bool = True,
        **config,
    ) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.queue = Queue()
        self.planner = StepPlanner(
            PlannerConfig(max_batch_prefill_tokens=max_batch_prefill_tokens, **config), self.allocator, self.queue
        )
        self.finished: list[Sequence] = []
        self.steps = 0
        self.planned: dict[int, Planned] = {}  # by sequence id, for the last step

    def submit(self, *sequences: Sequence) -> None:
        for sequence in sequences:
            self.queue.append(sequence)

    def step(self) -> StepPlan:
        """plan(), the step "runs", advance(), a token for each sequence that sampled, finished ones leave."""
        plan = self.planner.plan()
        self.planned = {s.id: Planned.of(s) for s in plan.sequences}
        assert len(self.planned) == len(plan.sequences), "a sequence is twice in the plan"
        self.planner.advance(plan)
        for sequence in plan.sequences:
            if not sequence.is_prefilling:  # decoding, or its chunk ended its prompt: it sampled
                # A token depending only on the request and position: a recomputed sequence sees the same ones.
                sequence.generated_ids.append(900_000 + sequence.id * 1_000 + len(sequence.generated_ids))
                if len(sequence.generated_ids) >= sequence.max_new_tokens:
                    sequence.status = SequenceStatus.FINISHED
                    self.planner.remove(sequence)
                    self.finished.append(sequence)
        self.steps += 1
        return plan

    def run(self, max_steps: int = 10_000, check=None) -> None:
        while len(self.queue) or self.planner.running:
            assert self.steps < max_steps, "the run does not end"
            plan = self.step()
            if check is not None:
                check(plan)

    def work_of(self, sequence: Sequence) -> Planned | None:
        """What the sequence computed at the last step, or None if it was not in it."""
        return self.planned.get(sequence.id)

    def tokens_of(self, sequence: Sequence) -> int:
        work = self.work_of(sequence)
        return 0 if work is None else work.tokens

    def work(self, sequences: list[Sequence]) -> list[tuple[Sequence, int]]:
        return [(s, self.tokens_of(s)) for s in sequences]


def sampled(sequence: Sequence) -> int:
    return len(sequence.generated_ids)


# --- tokens per step ----------------------------------------------------------------------------------------


def test_decoding_requests_get_one_token_each() -> None:
    sim = Sim()
    a, b, c = make_sequence(0, 5), make_sequence(1, 7), make_sequence(2, 20)
    sim.submit(a, b, c)
    plan = sim.step()
    assert sim.work(plan.admitted) == [(a, 5), (b, 7), (c, 20)]
    assert plan.running == []
    assert [sampled(s) for s in (a, b, c)] == [1, 1, 1]
    for step in range(3):
        plan = sim.step()
        assert plan.admitted == [] and plan.preempted == []
        assert sim.work(plan.running) == [(a, 1), (b, 1), (c, 1)]
        assert [s.num_computed_tokens for s in (a, b, c)] == [5 + step + 1, 7 + step + 1, 20 + step + 1]
        assert [sampled(s) for s in (a, b, c)] == [step + 2] * 3


def test_a_long_prompt_is_read_in_chunks_while_others_decode() -> None:
    sim = Sim(max_batch_prefill_tokens=16)
    a = make_sequence(0, 5)
    sim.submit(a)
    sim.step()
    long = make_sequence(1, 50)
    sim.submit(long)
    chunks = []
    for _ in range(4):
        sim.step()
        assert sim.tokens_of(a) == 1  # the decoding sequence never waits for the prompt
        chunks.append(sim.tokens_of(long))
    assert chunks == [16, 16, 16, 2]
    assert long.num_computed_tokens == long.num_prefill_tokens == 50
    assert sampled(long) == 1  # only the chunk that ended the prompt sampled
    assert sampled(a) == 5
    sim.step()
    assert sim.tokens_of(long) == 1 and sim.tokens_of(a) == 1


def test_only_the_last_chunk_samples() -> None:
    sim = Sim(max_batch_prefill_tokens=10)
    s = make_sequence(0, 25)
    sim.submit(s)
    history = []
    for _ in range(4):
        sim.step()
        history.append((sim.tokens_of(s), s.is_prefilling, sampled(s)))
    assert history == [(10, True, 0), (10, True, 0), (5, False, 1), (1, False, 2)]


def test_the_prompt_budget_is_shared_in_arrival_order() -> None:
    sim = Sim(max_batch_prefill_tokens=20)
    a, b, c, d = make_sequence(0, 8), make_sequence(1, 8), make_sequence(2, 8), make_sequence(3, 8)
    sim.submit(a, b, c, d)
    plan = sim.step()
    # c would fit only in part: read with a and b it would delay their first tokens and not bring its own.
    assert sim.work(plan.admitted) == [(a, 8), (b, 8)]
    assert len(sim.queue) == 2 and sim.queue.peek() is c
    plan = sim.step()
    assert sim.work(plan.running) == [(a, 1), (b, 1)]
    assert sim.work(plan.admitted) == [(c, 8), (d, 8)]
    assert sampled(c) == 1 and sampled(d) == 1


def test_a_steps_first_prompt_starts_in_part_and_later_ones_wait() -> None:
    """Several long prompts arriving together are read one after another (FCFS), each in as few steps as the
    budget allows, rather than side by side: the first one's first token comes after its own tokens only."""
    sim = Sim(max_batch_prefill_tokens=30)
    a, b = make_sequence(0, 20), make_sequence(1, 20)
    sim.submit(a, b)
    plan = sim.step()
    assert sim.work(plan.admitted) == [(a, 20)] and sampled(a) == 1
    plan = sim.step()
    assert sim.work(plan.admitted) == [(b, 20)]
    big = make_sequence(2, 50)  # longer than the budget: it starts in part, being the step's first
    sim.submit(big)
    sim.step()
    assert sim.tokens_of(big) == 30


def test_running_prompts_take_the_budget_before_newcomers() -> None:
    sim = Sim(max_batch_prefill_tokens=16)
    a = make_sequence(0, 40)
    sim.submit(a)
    sim.step()  # 16 of 40
    b = make_sequence(1, 4)
    sim.submit(b)
    plan = sim.step()
    assert sim.tokens_of(a) == 16 and plan.admitted == []  # nothing left for b
    plan = sim.step()
    assert sim.tokens_of(a) == 8 and sim.work(plan.admitted) == [(b, 4)]


# --- blocks on demand ---------------------------------------------------------------------------------------


def test_a_table_grows_exactly_when_the_sequence_crosses_a_block_boundary() -> None:
    bs = 4
    sim = Sim(block_size=bs)
    s = make_sequence(0, 6, max_new_tokens=20)
    sim.submit(s)
    sim.step()
    assert len(s.block_table) == 2  # ceil(6 / 4)
    assert sim.work_of(s).new_blocks == s.block_table  # nothing was cached: a newcomer's blocks are all new
    grown_at, table = [], list(s.block_table)
    while s in sim.planner.running:
        before = s.num_computed_tokens
        sim.step()
        work = sim.work_of(s)
        assert work.tokens == 1
        assert len(work.new_blocks) == (1 if before % bs == 0 else 0)
        if work.new_blocks:
            grown_at.append(before)
        table += work.new_blocks
        assert work.block_table == table  # new blocks are appended, old ones kept
        if s in sim.planner.running:
            assert s.block_table == table
            assert len(s.block_table) == sim.allocator.blocks_for(s.num_computed_tokens)
    assert len(table) == len(set(table)) == 7
    assert grown_at == [8, 12, 16, 20, 24]  # the 6-token prompt + 19 decoded tokens end at position 24
    assert sim.allocator.free_blocks == sim.allocator.num_blocks


def test_chunks_allocate_only_the_blocks_they_fill() -> None:
    bs = 4
    sim = Sim(max_batch_prefill_tokens=6, block_size=bs, num_blocks=100)
    s = make_sequence(0, 14)
    sim.submit(s)
    sim.step()
    assert sim.work_of(s).tokens == 6 and len(s.block_table) == 2
    assert sim.allocator.free_blocks == 98
    sim.step()
    assert sim.work_of(s).tokens == 6 and len(sim.work_of(s).new_blocks) == 1  # 12 tokens: 3 blocks
    sim.step()
    assert sim.work_of(s).tokens == 2 and len(sim.work_of(s).new_blocks) == 1  # 14 tokens: 4 blocks
    assert len(s.block_table) == 4 and len(set(s.block_table)) == 4


# --- preemption ---------------------------------------------------------------------------------------------


def test_the_newest_request_is_preempted_when_a_decode_needs_a_block() -> None:
    # 2 blocks of 4 tokens: a (4-token prompt) and b (2-token prompt) take one each; a's first decode is at
    # position 4 and needs a second block, which only b's can be.
    sim = Sim(block_size=4, num_blocks=2, prefix_caching=False, max_batch_size=2)
    a, b, c = make_sequence(0, 4, max_new_tokens=3), make_sequence(1, 2, max_new_tokens=4), make_sequence(2, 2)
    sim.submit(a, b, c)
    plan = sim.step()
    assert plan.admitted == [a, b]
    assert a.status is b.status is SequenceStatus.RUNNING and c.status is SequenceStatus.WAITING
    assert sim.allocator.free_blocks == 0
    b_generated = list(b.generated_ids)
    assert b_generated

    plan = sim.step()
    assert plan.preempted == [b]
    assert [(s, sim.tokens_of(s), len(sim.work_of(s).new_blocks)) for s in plan.running] == [(a, 1, 1)]
    assert plan.admitted == []  # nothing joins in a step that preempted
    assert sim.planner.running == [a]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_prefill_tokens == 0
    assert b.num_cached_blocks == 0 and b.step_tokens == 0 and b.step_new_blocks == []
    assert b.status is SequenceStatus.WAITING
    assert b.generated_ids == b_generated  # what it streamed is kept
    assert b.num_preemptions == 1
    assert sim.queue.peek() is b and len(sim.queue) == 2  # back at the front, ahead of c

    plan = sim.step()  # a's last token; b (3 tokens, 1 block) does not fit yet
    assert plan.running == [a] and plan.admitted == [] and plan.preempted == []
    assert a in sim.finished

    plan = sim.step()
    assert b in plan.admitted
    work = sim.work_of(b)
    # Recomputed from its prompt and the token it had generated, then it samples its next token.
    assert b.num_prefill_tokens == len(b.request.input_ids) + len(b_generated) == 3
    assert work.tokens == 3 and work.cache_len == 0
    assert b.generated_ids[: len(b_generated)] == b_generated and len(b.generated_ids) == len(b_generated) + 1


def test_the_lowest_priority_value_joins_first_then_arrival() -> None:
    sim = Sim(max_batch_size=1)
    late = [make_sequence(n, 2, max_new_tokens=1, priority=p) for n, p in enumerate([5, 0, 5, -1, 0])]
    sim.submit(*late)
    assert sim.queue.ordered() == [late[3], late[1], late[4], late[0], late[2]]
    admitted = [sim.step().admitted for _ in range(5)]
    assert admitted == [[late[3]], [late[1]], [late[4]], [late[0]], [late[2]]]


def test_the_highest_priority_value_is_preempted_first_not_the_newest() -> None:
    # As in the test above, but the newest (b) matters more: a, the older, is the one preempted.
    sim = Sim(block_size=4, num_blocks=2, prefix_caching=False, max_batch_size=2)
    a = make_sequence(0, 2, max_new_tokens=4, priority=1)
    b = make_sequence(1, 4, max_new_tokens=3, priority=0)
    sim.submit(a, b)
    plan = sim.step()
    assert plan.admitted == [b, a] and sim.planner.running == [b, a]  # the running set in (priority, arrival)
    plan = sim.step()  # b's first decode needs a second block, which only a's can be
    assert plan.preempted == [a] and sim.planner.running == [b]
    assert sim.queue.peek() is a


def test_a_request_preempts_itself_when_it_is_the_newest() -> None:
    sim = Sim(block_size=4, num_blocks=3, prefix_caching=False)
    a, b = make_sequence(0, 4, max_new_tokens=4), make_sequence(1, 4, max_new_tokens=4)
    sim.submit(a, b)
    sim.step()  # a: 1 block, b: 1 block, 1 left
    plan = sim.step()  # a takes the last block for position 4; b needs one too
    assert [(s, len(sim.work_of(s).new_blocks)) for s in plan.running] == [(a, 1)]
    assert plan.preempted == [b]
    assert sim.queue.peek() is b
    assert sim.allocator.free_blocks == 1  # b's block came back


def test_a_preempted_request_hits_its_own_cached_blocks_when_readmitted() -> None:
    # a: 4-token prompt (1 block); b: 10-token prompt (3 blocks, 2 of them full and cached once computed).
    sim = Sim(block_size=4, num_blocks=4, prefix_caching=True)
    a, b = make_sequence(0, 4, max_new_tokens=3), make_sequence(1, 10, max_new_tokens=5)
    sim.submit(a, b)
    sim.step()
    assert sim.allocator.free_blocks == 0 and sim.allocator.cached_blocks == 3  # a's block and b's 2 full ones
    b_full_blocks = b.block_table[:2]

    plan = sim.step()  # a needs a block at position 4: b goes; its private partial block is what a gets
    assert plan.preempted == [b]
    assert len(sim.work_of(a).new_blocks) == 1
    assert sim.work_of(a).new_blocks[0] not in b_full_blocks
    assert all(sim.allocator.refcount(x) == 0 for x in b_full_blocks)  # cached, read by nobody

    while b not in sim.planner.running:
        generated = list(b.generated_ids)
        plan = sim.step()
    assert plan.admitted == [b]
    work = sim.work_of(b)
    assert b.num_prefill_tokens == len(b.request.input_ids) + len(generated) == 11
    assert work.cache_len == 8 and plan.cache_hits == 8 and plan.cache_queries == 11
    assert work.tokens == 3  # the tail of the prompt and the token it had generated
    assert work.new_blocks == b.block_table[2:]  # the matched blocks were cached already: only the tail is new
    assert b.block_table[:2] == b_full_blocks and b.num_cached_blocks == 2
    assert b.cached_prompt_tokens == 0  # usage counts the read that gave its first token, all computed
    sim.run()
    assert len(b.generated_ids) == 5
    assert sim.allocator.free_blocks == sim.allocator.num_blocks


def _check_invariants(sim: Sim):
    """Checks each simulated step: the oldest progresses, preempting steps admit nothing, tables add up."""
    previous = {"running": []}

    def check(plan: StepPlan) -> None:
        before = previous["running"]
        if before:
            oldest = before[0]
            assert sim.tokens_of(oldest) > 0, f"the oldest request {oldest.id} made no progress"
            assert oldest not in plan.preempted
        if plan.preempted:
            assert plan.admitted == []
            # The newest are preempted: those that stay are all older than those that went.
            kept = [s for s in before if s not in plan.preempted]
            assert kept == before[: len(kept)]
        assert all(sim.tokens_of(s) > 0 for s in plan.sequences)
        running = sim.planner.running
        assert [s.id for s in running] == sorted(s.id for s in running)  # admission order
        assert all(s.status is SequenceStatus.RUNNING for s in running)
        queued = sim.queue.ordered()
        assert [s.id for s in queued] == sorted(s.id for s in queued)  # preempted ones went back ahead of the rest
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in queued)
        held: list[int] = []
        for s in running:
            # A sequence that drafted keeps the block its next token goes into (the shards cut theirs alike).
            assert len(s.block_table) == sim.allocator.blocks_for(s.num_computed_tokens + (s.step_drafts > 0))
            held += s.block_table
        private = [b for b in held if sim.allocator.refcount(b) is None]
        assert len(private) == len(set(private)), "a private block is in two tables"
        assert sim.allocator.free_blocks + len(set(held)) == sim.allocator.num_blocks
        previous["running"] = list(running)

    return check


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("budget", [7, 64])
def test_a_tiny_pool_preempts_but_every_request_finishes_without_leaking(prefix_caching: bool, budget: int) -> None:
    rng = random.Random(1234)
    bs, num_blocks = 4, 12
    sim = Sim(max_batch_prefill_tokens=budget, block_size=bs, num_blocks=num_blocks, prefix_caching=prefix_caching)
    shared = list(range(500, 512))  # some prompts share a 3-block prefix, so the cache has something to do
    sequences = []
    for n in range(16):
        length = rng.randint(1, 20)
        prompt = (shared + [n * 100 + i for i in range(length)]) if n % 3 == 0 else make_sequence(n, length).token_ids
        max_new = rng.randint(1, 40 - len(prompt))
        assert sim.allocator.blocks_for(len(prompt) + max_new) <= num_blocks  # each fits the pool alone
        sequences.append(make_sequence(n, prompt, max_new_tokens=max_new))
    sim.submit(*sequences)
    preemptions = 0

    check = _check_invariants(sim)

    def count(plan: StepPlan) -> None:
        nonlocal preemptions
        preemptions += len(plan.preempted)
        check(plan)

    sim.run(max_steps=5000, check=count)
    assert preemptions > 0, "the pool was meant to be too small for the batch"
    assert sorted(s.id for s in sim.finished) == list(range(16))  # every one finished, once
    for s in sequences:
        assert len(s.generated_ids) == s.max_new_tokens
        assert s.block_table == [] and s.num_computed_tokens == 0
    assert sum(s.num_preemptions for s in sequences) == preemptions
    assert sim.planner.running == [] and len(sim.queue) == 0
    assert sim.allocator.free_blocks == num_blocks  # no leak
    assert sim.allocator.stats.free_list + sim.allocator.stats.evictable == num_blocks


def test_recomputation_replays_the_generated_tokens() -> None:
    # After each preemption a request is re-read from its prompt and everything it had generated, then it
    # samples only new tokens: its stream never repeats or skips a position.
    sim = Sim(block_size=4, num_blocks=6, prefix_caching=False, max_batch_prefill_tokens=8)
    sequences = [make_sequence(n, 3 + n, max_new_tokens=12) for n in range(4)]
    sim.submit(*sequences)
    readmitted = 0
    while sim.queue or sim.planner.running:
        assert sim.steps < 1000
        generated = {s.id: len(s.generated_ids) for s in sequences}
        plan = sim.step()
        for s in plan.admitted:
            if s.num_preemptions:
                readmitted += 1
                work = sim.work_of(s)
                target = work.num_prefill_tokens
                assert target == len(s.request.input_ids) + generated[s.id]
                assert work.cache_len == 0 and 1 <= work.tokens <= min(target, 8)
                # It samples again only once all of that is read: one new token, never a repeated one.
                assert len(s.generated_ids) == generated[s.id] + (1 if work.tokens == target else 0)
    assert readmitted >= 2
    assert all(len(s.generated_ids) == 12 for s in sequences)
    assert sim.allocator.free_blocks == 6


# --- prefix cache -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_finished", [True, False])
def test_a_shared_three_block_prefix_is_read_from_the_cache(first_finished: bool) -> None:
    sim = Sim(block_size=16)
    prefix = list(range(100, 148))  # 3 blocks of 16
    first = make_sequence(0, prefix + [1, 2, 3, 4, 5], max_new_tokens=1 if first_finished else 50)
    sim.submit(first)
    sim.step()
    first_blocks = sim.work_of(first).block_table
    assert (first in sim.finished) is first_finished
    assert sim.allocator.cached_blocks == 3
    second = make_sequence(1, prefix + [7, 8, 9, 10])
    sim.submit(second)
    plan = sim.step()
    assert plan.admitted == [second]
    work = sim.work_of(second)
    assert work.cache_len == 48
    assert work.tokens == 4  # only what the cache does not hold
    assert plan.cache_hits == 48 and plan.cache_queries == 52
    assert second.num_computed_tokens == 52 and second.block_table[:3] == first_blocks[:3]
    assert second.num_cached_blocks == 3
    assert sim.allocator.stats.hit_blocks == 3
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 48)  # what their usage reports


def test_an_identical_prompt_still_computes_its_last_token() -> None:
    sim = Sim(block_size=16)
    prompt = list(range(100, 148))  # exactly 3 full blocks
    sim.submit(make_sequence(0, prompt, max_new_tokens=1))
    sim.step()
    assert sim.allocator.cached_blocks == 3
    again = make_sequence(1, prompt, max_new_tokens=1)
    sim.submit(again)
    plan = sim.step()
    assert plan.admitted == [again]
    work = sim.work_of(again)
    assert work.cache_len < len(prompt)
    assert work.cache_len == 32 and work.tokens == 16  # the last block is recomputed to sample from
    assert plan.cache_hits == 32
    assert again.generated_ids  # it sampled


def test_blocks_enter_the_cache_only_when_a_step_advanced() -> None:
    sim = Sim(block_size=16)
    prompt = list(range(100, 150))
    sim.submit(make_sequence(0, prompt), make_sequence(1, prompt))
    plan = sim.planner.plan()
    assert sim.allocator.cached_blocks == 0  # planned, never ran
    # Right after planning, a newcomer's computed tokens are its cache hit: the same step cannot share what it
    # computes.
    assert [s.num_computed_tokens for s in plan.admitted] == [0, 0]
    sim.planner.advance(plan)
    assert sim.allocator.cached_blocks == 3  # the first one's full blocks; the copy's stay private
    third = make_sequence(2, prompt)
    sim.submit(third)
    plan = sim.planner.plan()
    assert [(s, s.num_computed_tokens) for s in plan.admitted] == [(third, 48)]


def test_a_plan_that_never_ran_caches_nothing_for_a_chunk() -> None:
    sim = Sim(block_size=16, max_batch_prefill_tokens=20)
    s = make_sequence(0, 60)
    sim.submit(s)
    sim.step()  # 20 tokens: one full block
    assert sim.allocator.cached_blocks == 1
    sim.planner.plan()  # 40 tokens planned, but the step never ran
    assert sim.allocator.cached_blocks == 1


def test_without_prefix_caching_nothing_is_shared() -> None:
    sim = Sim(block_size=16, prefix_caching=False)
    prompt = list(range(100, 150))
    sim.submit(make_sequence(0, prompt, max_new_tokens=1))
    sim.step()
    sim.submit(make_sequence(1, prompt, max_new_tokens=1))
    plan = sim.step()
    assert sim.work_of(plan.admitted[0]).cache_len == 0 and plan.cache_hits == 0
    assert sim.allocator.cached_blocks == 0


# --- prompt logprobs ----------------------------------------------------------------------------------------


def test_decoder_input_details_reads_the_whole_prompt_with_no_cache_hit() -> None:
    sim = Sim(block_size=16, max_batch_prefill_tokens=16)
    prompt = list(range(100, 150))
    sim.submit(make_sequence(0, prompt, max_new_tokens=1))
    while sim.queue or sim.planner.running:
        sim.step()
    assert sim.allocator.cached_blocks == 3
    details = make_sequence(1, prompt, decoder_input_details=True)
    sim.submit(details)
    plan = sim.step()
    assert plan.admitted == [details]
    work = sim.work_of(details)
    assert work.cache_len == 0 and plan.cache_hits == 0
    assert work.tokens == 50  # over the 16-token budget: prompt logprobs need it in one step
    assert details.num_computed_tokens == 50 and sampled(details) == 1


def test_decoder_input_details_waits_for_a_step_of_its_own_first_place() -> None:
    sim = Sim(block_size=16, max_batch_prefill_tokens=16)
    small = make_sequence(0, 4)
    details = make_sequence(1, 30, decoder_input_details=True)
    behind = make_sequence(2, 4)
    sim.submit(small, details, behind)
    plan = sim.step()
    # 12 tokens left after `small`: not enough for the whole prompt, and nobody overtakes it.
    assert plan.admitted == [small]
    assert sim.queue.peek() is details
    plan = sim.step()
    assert sim.work(plan.admitted) == [(details, 30)]  # budget's exhausted: behind waits
    assert sim.queue.peek() is behind
    plan = sim.step()
    assert plan.admitted == [behind]


# --- scheduling modes ---------------------------------------------------------------------------------------


def test_sequential_runs_one_request_at_a_time() -> None:
    sim = Sim(scheduling="sequential")
    sequences = [make_sequence(n, 5, max_new_tokens=3) for n in range(3)]
    sim.submit(*sequences)
    admitted = []
    while sim.queue or sim.planner.running:
        was_running = bool(sim.planner.running)
        plan = sim.step()
        assert len(plan.admitted) <= 1
        if plan.admitted:
            assert not was_running
            admitted.append(plan.admitted[0])
        assert len(plan.sequences) == 1
    assert admitted == sequences
    assert sim.steps == 9  # 3 steps each, never overlapping


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(static, "time", SimpleNamespace(monotonic=clock))
    return clock


def test_static_waits_for_a_full_batch_then_runs_it_to_completion(clock: Clock) -> None:
    sim = Sim(scheduling="static", max_batch_size=3, static_batch_timeout=5.0)
    a, b = make_sequence(0, 4, max_new_tokens=2, queued_at=clock.now), make_sequence(1, 4, queued_at=clock.now)
    sim.submit(a, b)
    assert sim.step().empty
    assert sim.planner.next_deadline() == clock.now + 5.0
    clock.now += 4.0
    assert sim.step().empty  # 2 of 3, and 1 second left
    c = make_sequence(2, 4, max_new_tokens=3, queued_at=clock.now)
    sim.submit(c)
    plan = sim.step()  # full: the batch starts at once
    assert plan.admitted == [a, b, c]
    assert sim.planner.next_deadline() is None  # running: nothing waits on a timeout

    late = [make_sequence(n, 4, queued_at=clock.now) for n in (3, 4, 5)]
    sim.submit(*late)  # a full batch waits, and times out too
    clock.now += 100.0
    while b in sim.planner.running:  # a, then c, finish first: the batch still admits nobody
        plan = sim.step()
        assert plan.admitted == []
    assert a in sim.finished and c in sim.finished and b in sim.finished
    assert sim.queue.peek() is late[0]
    plan = sim.step()  # the batch is over: the next one starts
    assert plan.admitted == late


def test_static_reads_every_prompt_of_its_batch_at_once(clock: Clock) -> None:
    # As a padded static batch would: the per-step prompt budget does not split the batch.
    sim = Sim(scheduling="static", max_batch_size=3, max_batch_prefill_tokens=10)
    sequences = [make_sequence(n, 8, queued_at=clock.now) for n in range(3)]
    sim.submit(*sequences)
    plan = sim.step()
    assert sim.work(plan.admitted) == [(s, 8) for s in sequences]
    assert all(sampled(s) == 1 for s in sequences)


def test_static_admits_a_partial_batch_after_the_timeout(clock: Clock) -> None:
    sim = Sim(scheduling="static", max_batch_size=4, static_batch_timeout=1.0)
    a, b = make_sequence(0, 4, queued_at=clock.now), make_sequence(1, 4, queued_at=clock.now + 0.5)
    sim.submit(a, b)
    clock.now = 1000.5
    assert sim.step().empty
    clock.now = 1001.0  # the oldest has waited static_batch_timeout
    plan = sim.step()
    assert plan.admitted == [a, b]


def test_static_with_an_old_sequence_needs_no_clock() -> None:
    sim = Sim(scheduling="static", max_batch_size=8, static_batch_timeout=1.0)
    old = make_sequence(0, 4)
    old.queued_at -= 10.0
    sim.submit(old)
    assert sim.step().admitted == [old]


def test_static_batch_size_defaults_to_32(clock: Clock) -> None:
    sim = Sim(scheduling="static")
    sim.submit(*[make_sequence(n, 2, queued_at=clock.now) for n in range(31)])
    assert sim.step().empty
    sim.submit(*[make_sequence(n, 2, queued_at=clock.now) for n in range(31, 40)])
    plan = sim.step()
    assert [s.id for s in plan.admitted] == list(range(32))


def test_every_scheduling_flag_value_names_a_policy() -> None:
    assert tuple(POLICIES) == SCHEDULING  # --scheduling's choices
    assert isinstance(StepPlanner(PlannerConfig(1), BlockAllocator(1, 1), Queue()).policy, Continuous)  # the default
    with pytest.raises(ValueError, match="unknown scheduling 'fifo'"):
        policy_for("fifo")


def test_continuous_respects_max_batch_size() -> None:
    sim = Sim(max_batch_size=2)
    sequences = [make_sequence(n, 4, max_new_tokens=2 + n) for n in range(5)]
    sim.submit(*sequences)
    plan = sim.step()
    assert plan.admitted == sequences[:2]
    admitted_at = {}
    while sim.queue or sim.planner.running:
        plan = sim.step()
        assert len(sim.planner.running) <= 2
        assert len(plan.sequences) <= 2
        for s in plan.admitted:
            admitted_at[s.id] = sim.steps
    # A slot frees as soon as a request finishes, and the next one joins at the following step.
    assert sorted(admitted_at) == [2, 3, 4]
    assert sorted(s.id for s in sim.finished) == [0, 1, 2, 3, 4]


def test_continuous_joins_while_others_run() -> None:
    sim = Sim()
    a = make_sequence(0, 4, max_new_tokens=10)
    sim.submit(a)
    sim.step()
    b = make_sequence(1, 4)
    sim.submit(b)
    plan = sim.step()
    assert plan.running == [a] and plan.admitted == [b]
    assert plan.sequences == [a, b]


@pytest.mark.parametrize("watermark", [0, 2])
def test_watermark_keeps_blocks_for_running_requests(watermark: int) -> None:
    sim = Sim(block_size=4, num_blocks=6, watermark_blocks=watermark)
    a, b = make_sequence(0, 4), make_sequence(1, 4)
    sim.submit(a, b)
    plan = sim.step()
    # a joins an empty batch (no reserve); b leaves 4 free blocks, which the reserve allows.
    assert plan.admitted == [a, b]
    c = make_sequence(2, 4)
    sim.submit(c)
    plan = sim.step()  # a and b take a block each for position 4: 2 free; c would leave 1
    if watermark:
        assert plan.admitted == [] and sim.queue.peek() is c
    else:
        assert plan.admitted == [c]


# --- randomized runs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduling", list(POLICIES))
def test_random_workloads_all_finish_with_the_invariants_kept(scheduling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small pools, small vocabularies (many shared prefixes and cache conflicts), staggered arrivals, prompt
    logprobs, watermarks: every request gets all its tokens, every step keeps the invariants, nothing leaks."""
    monkeypatch.setattr(static, "time", SimpleNamespace(monotonic=lambda: 1e9))  # static timeouts passed
    for seed in range(150):
        rng = random.Random(seed)
        bs, num_blocks = rng.choice([1, 2, 4, 16]), rng.randint(3, 30)
        sim = Sim(
            max_batch_prefill_tokens=rng.choice([1, 3, 7, 16, 64]),
            block_size=bs,
            num_blocks=num_blocks,
            prefix_caching=rng.random() < 0.6,
            scheduling=scheduling,
            max_batch_size=rng.choice([None, 1, 2, 5]),
            watermark_blocks=rng.choice([0, 0, 1, 2]),
            static_batch_timeout=0.0,
            speculate=rng.choice([0, 0, 3, 8]),  # drafts reserve blocks for a step; the step gives them back
            speculate_max_batch=rng.choice([1, 4, 64]),
        )
        capacity = num_blocks * bs
        shared = [rng.randint(0, 5) for _ in range(rng.randint(0, capacity // 2))]
        arrivals = sorted(rng.randint(0, 20) for _ in range(rng.randint(1, 12)))
        sequences = []
        for n in range(len(arrivals)):
            tail = [rng.randint(0, 5) for _ in range(rng.randint(1, max(1, capacity // 2)))]
            prompt = (shared[: rng.randint(0, len(shared))] + tail)[: max(1, capacity - 1)]
            max_new = rng.randint(1, max(1, capacity - len(prompt)))  # each fits the pool alone
            details = rng.random() < 0.15
            sequences.append(make_sequence(n, prompt, max_new_tokens=max_new, decoder_input_details=details))
        check = _check_invariants(sim)
        waiting = list(zip(arrivals, sequences))
        while waiting or sim.queue or sim.planner.running:
            while waiting and waiting[0][0] <= sim.steps:
                sim.submit(waiting.pop(0)[1])
            assert sim.steps < 5000, f"seed {seed}: the run does not end"
            check(sim.step())
        assert [len(s.generated_ids) for s in sequences] == [s.max_new_tokens for s in sequences], f"seed {seed}"
        assert sim.allocator.free_blocks == num_blocks, f"seed {seed}: blocks leaked"


def test_prompts_are_read_in_small_chunks_only_while_someone_decodes() -> None:
    sim = Sim(max_batch_prefill_tokens=100, prefill_chunk_tokens=8)
    burst = [make_sequence(n, 30) for n in range(3)]
    sim.submit(*burst)
    plan = sim.step()  # nobody decodes yet: the whole budget, for the shortest time to first token
    assert [sim.tokens_of(s) for s in plan.admitted] == [30, 30, 30]
    late = make_sequence(3, 20)
    sim.submit(late)
    chunks = []
    while late.is_prefilling or late.num_prefill_tokens == 0:
        sim.step()
        assert all(sim.tokens_of(s) == 1 for s in burst)
        chunks.append(sim.tokens_of(late))
    assert chunks == [8, 8, 4]


# --- replay after a failed step -----------------------------------------------------------------------------


def test_a_suspect_joins_alone_and_nobody_joins_until_it_has_read_its_tokens_back() -> None:
    """Sequences replayed after a failed step are suspects: each joins a step of its own and holds admission
    until its prompt and generated tokens are read back, so a second failure is blamed on one of them only."""
    sim = Sim(max_batch_prefill_tokens=8, prefill_chunk_tokens=8)
    first, second = make_sequence(0, 20), make_sequence(1, 4)
    fresh = make_sequence(2, 4)
    for suspect in (first, second):
        suspect.suspect = True
    sim.submit(first, second, fresh)
    plan = sim.step()
    assert plan.admitted == [first] and first.suspect  # alone, and its prompt takes three chunks of 8
    while first.is_prefilling:
        assert sim.step().admitted == []
    assert not first.suspect  # read back: no longer suspect
    plan = sim.step()
    assert plan.admitted == [second]  # the next suspect, alone again, beside the proven one decoding
    assert sim.step().admitted == [fresh]


# --- decode runs ----------------------------------------------------------------------------------------------


def decoding(sim: Sim, *sequences: Sequence) -> None:
    """Admits the sequences and runs their prompts: they are all decoding afterwards."""
    sim.submit(*sequences)
    assert sim.step().steps == 1  # sequences joined: never a run
    assert not any(s.is_prefilling for s in sequences)


def test_decoding_sequences_with_nobody_waiting_make_a_run_that_holds_its_blocks_up_front() -> None:
    sim = Sim(max_decode_steps=8)
    long, short = make_sequence(0, 14, max_new_tokens=30), make_sequence(1, 5, max_new_tokens=3)
    decoding(sim, long, short)
    plan = sim.planner.plan()
    assert plan.steps == 8 and plan.running == [long, short]
    # 14 computed + 8 fed: a second block, announced with the run; the short one feeds its 2 tokens in its block.
    assert len(long.block_table) == 2 and long.step_new_blocks == long.block_table[1:]
    assert len(short.block_table) == 1 and short.step_new_blocks == []
    assert long.step_tokens == short.step_tokens == 1  # the scheduler advances each by one per step that ran


def test_a_run_is_no_longer_than_the_longest_remaining_request() -> None:
    sim = Sim(max_decode_steps=8)
    a, b = make_sequence(0, 5, max_new_tokens=3), make_sequence(1, 5, max_new_tokens=4)
    decoding(sim, a, b)
    assert sim.planner.plan().steps == 3  # b has 3 tokens to go after its first


def test_no_run_while_a_request_could_join_but_one_while_the_batch_is_full() -> None:
    sim = Sim(max_decode_steps=8, max_batch_size=2)
    a, b = make_sequence(0, 5, max_new_tokens=20), make_sequence(1, 5, max_new_tokens=20)
    decoding(sim, a)
    sim.submit(b)
    assert sim.step().steps == 1  # b joins: one step
    waiting = make_sequence(2, 5)
    sim.submit(waiting)  # cannot join a full batch: the run goes on meanwhile
    assert not sim.planner.waiting_to_join() and sim.planner.plan().steps == 8
    sim.planner.remove(b)
    assert sim.planner.waiting_to_join()  # room now: the next plan admits it, in one step


def test_no_run_without_the_blocks_for_it_or_with_a_prompt_still_being_read() -> None:
    sim = Sim(max_decode_steps=8, num_blocks=3, block_size=4)
    a, b = make_sequence(0, 3, max_new_tokens=20), make_sequence(1, 3, max_new_tokens=20)
    decoding(sim, a, b)
    assert sim.allocator.free_blocks == 1
    plan = sim.planner.plan()  # 8 more tokens each would need 4 more blocks: one step, as before, preempting nobody
    assert plan.steps == 1 and not plan.preempted and sim.allocator.free_blocks == 1

    chunked = Sim(max_decode_steps=8, max_batch_prefill_tokens=8)
    c, d = make_sequence(0, 5, max_new_tokens=20), make_sequence(1, 40, max_new_tokens=20)
    decoding(chunked, c)
    chunked.submit(d)
    chunked.step()
    assert d.is_prefilling and chunked.planner.plan().steps == 1  # d still reads its prompt: one step at a time


def test_runs_are_off_by_default() -> None:
    sim = Sim()
    decoding(sim, make_sequence(0, 5, max_new_tokens=20))
    assert sim.planner.plan().steps == 1


# --- speculative decoding -----------------------------------------------------------------------------------


def test_a_small_batch_of_decoding_sequences_gets_draft_budgets_and_their_blocks() -> None:
    sim = Sim(speculate=8, speculate_max_batch=2)
    a, b = make_sequence(0, 14, max_new_tokens=30), make_sequence(1, 5, max_new_tokens=4)
    decoding(sim, a, b)
    plan = sim.planner.plan()
    assert plan.steps == 1 and plan.running == [a, b]
    assert a.step_drafts == 8 and b.step_drafts == 2  # b: 4 new tokens, 1 made, the next one its own
    assert a.step_tokens == b.step_tokens == 1  # what is computed for sure: the next token
    assert len(a.block_table) == 2 and a.step_new_blocks == a.block_table[1:]  # 14 + 1 + 8 KV slots


def test_a_step_advances_by_the_drafts_accepted_and_gives_back_the_blocks_past_the_next_token() -> None:
    sim = Sim(speculate=8)
    a = make_sequence(0, 14, max_new_tokens=30)
    decoding(sim, a)
    free = sim.allocator.free_blocks
    plan = sim.planner.plan()
    assert a.step_drafts == 8 and sim.allocator.free_blocks == free - 1
    a.generated_ids.append(7)  # every draft rejected: the step made its one token
    sim.planner.advance(plan, {a.id: 1})
    assert a.num_computed_tokens == 15 and len(a.block_table) == 1 and sim.allocator.free_blocks == free

    plan = sim.planner.plan()
    a.generated_ids.extend([8, 9, 10])  # two drafts accepted, then the target's own token
    sim.planner.advance(plan, {a.id: 3})
    assert a.num_computed_tokens == 18 and len(a.block_table) == 2  # slot 18, the next token's, is in block 2


def test_drafts_never_preempt_they_shrink_to_the_free_blocks() -> None:
    sim = Sim(speculate=8, num_blocks=2, block_size=4)
    a = make_sequence(0, 3, max_new_tokens=20)
    decoding(sim, a)
    plan = sim.planner.plan()
    assert a.step_drafts == 4 and not plan.preempted and sim.allocator.free_blocks == 0  # 3 + 1 + 4 = 8 slots


def test_no_drafts_in_a_large_batch_or_for_penalised_constrained_or_unwilling_requests() -> None:
    from conveyor.router.api.tgi import Sampling

    large = Sim(speculate=4, speculate_max_batch=1)
    a, b = make_sequence(0, 5, max_new_tokens=20), make_sequence(1, 5, max_new_tokens=20)
    decoding(large, a, b)
    large.planner.plan()
    assert a.step_drafts == b.step_drafts == 0

    sim = Sim(speculate=4)
    penalised, unwilling, modest = (make_sequence(n, 5, max_new_tokens=20) for n in range(3))
    penalised.request = _with(penalised, sampling=Sampling(repetition_penalty=1.3))
    unwilling.request = _with(unwilling, speculate=0)
    modest.request = _with(modest, speculate=2)
    decoding(sim, penalised, unwilling, modest)
    sim.planner.plan()
    assert (penalised.step_drafts, unwilling.step_drafts, modest.step_drafts) == (0, 0, 2)


def _with(sequence: Sequence, **parameters) -> ValidRequest:
    from dataclasses import replace

    return replace(sequence.request, parameters=replace(sequence.request.parameters, **parameters))


def test_speculation_is_off_by_default_in_the_planner() -> None:
    sim = Sim()
    a = make_sequence(0, 5, max_new_tokens=20)
    decoding(sim, a)
    sim.planner.plan()
    assert a.step_drafts == 0


def _scoped(n: int, prompt: list[int], salt: str | None, adapter: str | None) -> Sequence:
    parameters = Parameters(max_new_tokens=2, cache_salt=salt, adapter=adapter)
    return Sequence(
        id=n, request=ValidRequest(inputs="x" * len(prompt), input_ids=tuple(prompt), parameters=parameters)
    )


@pytest.mark.parametrize(
    "planter, victim",
    [
        (("victim-salt|adapter:sql", None), ("victim-salt", "sql")),  # a salt spelling the joined scope of old
        (("s", "a|adapter:b"), ("s|adapter:a", "b")),
        ((None, "sql"), ("key:default", "sql")),  # a salt spelling a key's scope
    ],
)
def test_no_salt_or_adapter_name_reaches_another_scopes_blocks(planter: tuple, victim: tuple) -> None:
    """What key B computes under one (salt, adapter) is never served to a request of another, whatever characters
    the free-text salt holds: before scopes were fields, the first case read B's base-model KV as A's adapter's."""
    sim = Sim(block_size=4)
    prompt = list(range(100, 117))
    planted = _scoped(1, prompt, *planter)
    sim.submit(planted)
    sim.run()
    assert sim.allocator.cached_blocks == 4
    target = _scoped(2, prompt, *victim)
    assert target.cache_scope != planted.cache_scope
    sim.submit(target)
    sim.step()
    assert sim.work_of(target).cache_len == 0  # nothing of B's was taken for A's


# --- drafts ---------------------------------------------------------------------------------------------------


def test_drafts_go_where_the_measured_costs_say_they_pay() -> None:
    """Without step costs every decoding sequence may have `speculate` drafts; with them, one whose drafts were
    rejected gets none and one whose drafts were kept gets them all, with the blocks they need."""
    cheap_rows = StepCosts((1, 2, 5, 9), (0.020, 0.0205, 0.022, 0.024))
    for costs, expected in ((None, [4, 4]), (cheap_rows, [0, 4])):
        sim = Sim(speculate=4, step_costs=costs)
        rejecting, accepting = make_sequence(0, 15, max_new_tokens=50), make_sequence(1, 15, max_new_tokens=50)
        sim.submit(rejecting, accepting)
        sim.step()
        if sim.planner.drafts is not None:
            for _ in range(10):
                sim.planner.drafts.record(rejecting.draft_record, drafted=4, accepted=0)
                sim.planner.drafts.record(accepting.draft_record, drafted=4, accepted=4)
        sim.planner.plan()
        assert [s.step_drafts for s in (rejecting, accepting)] == expected
        assert all(len(s.block_table) * 16 >= s.num_computed_tokens + 1 + s.step_drafts for s in (rejecting, accepting))
