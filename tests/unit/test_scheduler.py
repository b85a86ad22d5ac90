"""The batching loop without processes: its waiting rule (a burst at an idle server is queued whole first, on a fake
clock), its replay after a failed step, and what it sends the shards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import monotonic
from types import SimpleNamespace

from conveyor.router.core.block_allocator import BlockAllocator
from conveyor.router.core.replay import replay
from conveyor.router.core.scheduler import Scheduler
from conveyor.router.core.sequence import Sequence
from conveyor.router.core.settle import LOOKS_PER_GAP, SETTLE_QUIET_SECONDS, SETTLE_SECONDS, Settle
from conveyor.router.core.step_planner import PlannerConfig
from conveyor.router.metrics import Metrics
from conveyor.router.pipeline.request import Parameters, ValidRequest
from conveyor.router.transport.records import (
    CachedBatch,
    GeneratedText,
    Generation,
    RequestUpdate,
    ShardInfo,
    StepResult,
    Timings,
    Tokens,
)
from conveyor.router.transport.shard_client import ShardError
from conveyor.v1 import shard_pb2 as pb


def sequence(n: int, input_length: int, max_new_tokens: int = 10) -> Sequence:
    request = ValidRequest(
        inputs="x" * input_length,
        input_ids=tuple(range(input_length)),
        parameters=Parameters(max_new_tokens=max_new_tokens),
    )
    return Sequence(id=n, request=request)


def scheduler() -> Scheduler:
    return Scheduler(None, PlannerConfig(max_batch_prefill_tokens=1000), BlockAllocator(64, 16), Metrics())


class FakeTime:
    """A clock that moves only when the rule under test sleeps: arrivals happen at their own time, whatever the
    load on the machine, and each sleep also lets the event loop take one turn (for arrivals that need turns)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.arrivals: list[tuple[float, Callable[[], None]]] = []

    def at(self, when: float, arrive: Callable[[], None]) -> None:
        self.arrivals.append((when, arrive))

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        due = sorted((a for a in self.arrivals if a[0] <= self.now), key=lambda a: a[0])
        self.arrivals = [a for a in self.arrivals if a[0] > self.now]
        for _, arrive in due:
            arrive()
        await asyncio.sleep(0)

    def settle(self) -> Settle:
        return Settle(clock=self.clock, sleep=self.sleep)


def on_fake_time() -> tuple[Scheduler, FakeTime]:
    s, time = scheduler(), FakeTime()
    s.settle = time.settle()
    return s, time


def queued(s: Scheduler) -> Callable[[], int]:
    return lambda: len(s.queue)


async def test_an_idle_server_waits_for_a_burst_that_is_still_arriving() -> None:
    s, time = on_fake_time()

    async def arrive(n: int) -> None:
        for _ in range(n):  # a handler that parses and validates for a few turns, then queues
            await asyncio.sleep(0)
        s.submit(sequence(n, 8))

    arrivals = [asyncio.create_task(arrive(n)) for n in range(10)]
    await s.settle.wait(queued(s))
    assert len(s.queue) == len(arrivals)
    plan = s.planner.plan()
    assert len(plan.admitted) == len(arrivals)  # one first step for the whole burst
    await asyncio.gather(*arrivals)


async def test_arrivals_closer_than_the_quiet_gap_are_one_burst() -> None:
    s, time = on_fake_time()
    s.submit(sequence(0, 8))
    for n in range(1, 6):
        time.at(n * SETTLE_QUIET_SECONDS / 4, lambda n=n: s.submit(sequence(n, 8)))
    await s.settle.wait(queued(s))
    assert len(s.queue) == 6
    look = SETTLE_QUIET_SECONDS / LOOKS_PER_GAP  # an arrival is seen at the first look after it
    assert time.now <= 5 * SETTLE_QUIET_SECONDS / 4 + look + SETTLE_QUIET_SECONDS + 1e-9  # one gap after the last


async def test_an_arrival_after_the_quiet_gap_waits_for_the_next_step() -> None:
    s, time = on_fake_time()
    s.submit(sequence(0, 8))
    time.at(SETTLE_QUIET_SECONDS * 1.5, lambda: s.submit(sequence(1, 8)))
    await s.settle.wait(queued(s))
    assert len(s.queue) == 1
    assert SETTLE_QUIET_SECONDS <= time.now < SETTLE_QUIET_SECONDS * 1.5


async def test_a_trickle_that_never_stops_does_not_hold_the_first_step_forever() -> None:
    s, time = on_fake_time()
    gap = SETTLE_QUIET_SECONDS / 5
    for n in range(1, 1000):  # far more than SETTLE_SECONDS can take
        time.at(n * gap, lambda n=n: s.submit(sequence(n, 8)))
    await s.settle.wait(queued(s))
    assert SETTLE_SECONDS <= time.now < SETTLE_SECONDS + SETTLE_QUIET_SECONDS
    assert len(s.queue) == round(time.now / gap)  # every arrival until the limit, none after


def test_the_scheduler_settles_on_the_real_clock_by_default() -> None:
    settle = scheduler().settle
    assert (settle.quiet, settle.limit) == (SETTLE_QUIET_SECONDS, SETTLE_SECONDS)
    assert settle.clock is monotonic and settle.sleep is asyncio.sleep


def test_every_sampling_parameter_reaches_the_shard_under_its_name() -> None:
    from conveyor.router.api.tgi import Sampling
    from conveyor.router.transport.wire import sampling_pb

    # A field of the schema the shard proto lacks would be dropped on the way.
    assert set(Sampling.model_fields) <= {f.name for f in pb.SamplingParameters.DESCRIPTOR.fields}
    sampling = Sampling(
        temperature=0.5,
        top_k=7,
        top_p=0.9,
        typical_p=0.8,
        min_p=0.05,
        seed=11,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.4,
    )
    message = sampling_pb(Parameters(sampling=sampling))
    assert message.do_sample  # temperature != 1 implies sampling (TGI's rule)
    for name in [n for n, v in sampling if isinstance(v, float)]:
        assert abs(getattr(message, name) - getattr(sampling, name)) < 1e-6, name
    assert (message.top_k, message.seed) == (7, 11)
    assert sampling_pb(Parameters()).seed == 0 and not sampling_pb(Parameters()).do_sample
    assert sampling_pb(Parameters(sampling=Sampling(min_p=0.1))).do_sample  # min_p is a warper: it samples


def _running(s: Scheduler, count: int) -> list[Sequence]:
    sequences = [sequence(n, 8) for n in range(count)]
    for each in sequences:
        s.submit(each)
    assert s.planner.plan().admitted == sequences
    return sequences


def test_a_failed_step_puts_the_running_sequences_back_in_order_as_suspects() -> None:
    s = scheduler()
    running = _running(s, 3)
    running[1].generated_ids = [7, 8]
    assert replay(s.planner, s.max_request_retries, "shard 0 failed Decode") == 3
    assert s.queue.take_all() == running  # at the front, in admission order, holding no block
    assert all(r.suspect and r.num_replays == 1 and not r.block_table for r in running)
    assert s.allocator.free_blocks == s.allocator.num_blocks
    assert running[1].generated_ids == [7, 8]  # kept: the replay reads them back, the stream goes on after them


def test_a_failure_with_a_suspect_in_the_step_is_blamed_on_the_suspect_alone() -> None:
    s = scheduler()
    innocent, crasher = _running(s, 2)
    crasher.suspect, crasher.num_replays = True, 2  # replayed twice already
    assert replay(s.planner, s.max_request_retries, "shard 0 failed Prefill") == 1
    assert innocent.num_replays == 0 and innocent in s.queue.take_all()
    assert crasher.is_finished and crasher not in s.running  # a third failure: past max_request_retries (2)
    error = crasher.events.get_nowait()
    assert error.error_type == "generation" and "3 failed steps" in error.message


class _LostShards:
    """A client whose shards are gone: FilterBatch fails as a killed rank's does."""

    restart_group = None  # one node

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> None:
        raise ShardError("shard 0 failed FilterBatch: Stream removed")

    async def clear_cache(self, batch_id: int) -> None:
        raise ShardError("shard 0 failed ClearCache: Stream removed")

    async def close(self) -> None:
        pass


async def test_shards_lost_while_dropping_preempted_sequences_void_the_planned_step() -> None:
    """Found by the soak: the loop went on to decode the step it had planned, with no batch left (a TypeError
    that killed the router). Dropping must say the plan is void, with every sequence back in the queue."""
    s = scheduler()
    s.client = _LostShards()
    s.reconnect = _reconnected(s)
    running = _running(s, 3)
    preempted = running[2]
    s.planner.requeue(preempted)
    s.batch = CachedBatch(id=1, request_ids=[r.id for r in running], size=3)
    assert await s.drop_preempted([preempted]) is False
    assert s.batch is None and not s.running and not s.recovering
    assert set(s.queue.take_all()) == set(running)


def _reconnected(s: Scheduler):
    async def reconnect() -> SimpleNamespace:
        return SimpleNamespace(client=s.client, num_blocks=s.allocator.num_blocks, info=ShardInfo())

    return reconnect


class _Shards:
    """A client whose ranks answer Info as `answer` instances (None: they do not answer)."""

    def __init__(self, instances: list[str]) -> None:
        self.instances, self.answer, self.step_timeout = instances, instances, None
        self.killed = False
        self.restart_group = None  # one node

    async def infos(self, timeout: float | None = None) -> list[SimpleNamespace]:
        if self.answer is None:
            raise ShardError("shard 0 failed Info: failed to connect to all addresses")
        return [SimpleNamespace(instance=i) for i in self.answer]

    def kill(self) -> None:
        self.killed = True

    async def close(self) -> None:
        pass


def _restarts(s: Scheduler) -> float:
    return s.metrics.registry.get_sample_value("conveyor_shard_restarts_total")


async def test_an_idle_check_reconnects_only_to_restarted_or_silent_shards() -> None:
    s = scheduler()
    s.client = _Shards(["a", "b"])
    s.reconnect = _reconnected(s)
    await s.check_shards()
    assert _restarts(s) == 0  # the same processes: nothing to do
    s.client.answer = ["a", "c"]  # rank 1 was restarted, and is not warmed up
    await s.check_shards()
    assert _restarts(s) == 1 and not s.recovering and not s.client.killed
    s.client.answer = None  # down (its launcher restarts it): reconnect when it answers
    await s.check_shards()
    assert _restarts(s) == 2


class _SilentShards(_Shards):
    """Ranks whose Info never answers (a shard stopped, as tests/e2e/test_priority.py does with SIGSTOP)."""

    async def infos(self, timeout: float | None = None) -> list[SimpleNamespace]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_an_arrival_cuts_an_idle_check_short() -> None:
    """Found by tests/e2e/test_priority.py: a request that came while the idle check waited on a stopped shard's Info
    was admitted only after the shard answered, so the next arrival overtook it. The arrival ends the check."""
    s = scheduler()
    s.client = _SilentShards(["a"])
    s.reconnect = _reconnected(s)
    check = asyncio.ensure_future(s.check_shards())
    await asyncio.sleep(0)
    assert not check.done()
    s.wake()
    await asyncio.wait_for(check, 30)
    assert _restarts(s) == 0


class _RunShards:
    """Shards whose decode run answers the step results the test hands them, one at a time."""

    def __init__(self) -> None:
        self.step_timeout = None
        self.results: asyncio.Queue = asyncio.Queue()
        self.started: list[tuple[int, list[RequestUpdate]]] = []  # (max_steps, updates) of each run
        self.stopping = False

    async def decode_run(self, batches, max_steps, metadata=None, updates=()):
        self.started.append((max_steps, list(updates)))
        return self

    async def next(self):
        return await self.results.get()

    async def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        pass


def _step(batch_ids: list[int], tokens: dict[int, int], finished: tuple[int, ...] = ()) -> StepResult:
    generations = [
        Generation(
            request_id=n,
            tokens=Tokens(ids=[t], logprobs=[0.0], texts=["t"], is_special=[False]),
            finished=GeneratedText(text="t", generated_tokens=1, finish_reason="length", seed=None)
            if n in finished
            else None,
        )
        for n, t in tokens.items()
    ]
    batch = CachedBatch(id=0, request_ids=batch_ids, size=len(batch_ids)) if batch_ids else None
    return StepResult(generations, batch, Timings())


def test_the_finished_event_counts_the_prompt_tokens_both_cache_tiers_served() -> None:
    """The planner counts the memory tier's hit at admission; the shards' disk-tier reads come with the prompt's
    first token, and only then: a later generation's (a replay's read after a preemption) does not count again."""
    s = scheduler()
    a = sequence(0, 40, max_new_tokens=2)
    s.submit(a)
    assert s.planner.plan().admitted == [a] and a.cached_prompt_tokens == 0  # an empty cache: nothing in memory
    first = _step([0], {0: 11})
    first.generations[0].disk_cached_tokens = 32
    s.delivery.deliver(first)
    last = _step([], {0: 12}, finished=(0,))
    last.generations[0].disk_cached_tokens = 16
    s.delivery.deliver(last)
    events = [a.events.get_nowait() for _ in range(a.events.qsize())]
    assert [e.token.id for e in events] == [11, 12]
    assert events[-1].finished is not None and events[-1].finished.cached_tokens == 32


async def test_a_decode_run_streams_each_step_lets_finished_ones_go_and_stops_for_an_arrival() -> None:
    s = Scheduler(
        None, PlannerConfig(max_batch_prefill_tokens=1000, max_decode_steps=4), BlockAllocator(64, 16), Metrics()
    )
    a, b = _running(s, 2)
    s.planner.advance(SimpleNamespace(sequences=[a, b]))  # prompts read: both decode now
    s.batch = CachedBatch(id=0, request_ids=[0, 1], size=2)
    s.client = shards = _RunShards()
    plan = s.planner.plan()
    assert plan.steps == 4
    running = asyncio.ensure_future(s.step(plan))
    shards.results.put_nowait(_step([0], {0: 11, 1: 21}, finished=(1,)))  # b finishes at the first step
    shards.results.put_nowait(_step([0], {0: 12}))
    await wait_until(lambda: a.generated_ids == [11, 12])
    assert b.is_finished and b not in s.running and b.block_table == []  # gone at once, its blocks free
    assert a.num_computed_tokens == 10 and not shards.stopping
    s.submit(sequence(5, 8))  # an arrival that can join: the run stops after the step in progress
    shards.results.put_nowait(_step([0], {0: 13}))
    await wait_until(lambda: shards.stopping)
    shards.results.put_nowait(None)  # the shards end the run
    await running
    assert a.generated_ids == [11, 12, 13] and a.num_computed_tokens == 11 and s.batch.request_ids == [0]
    runs = [s.metrics.registry.get_sample_value(f"conveyor_decode_runs{cut}_total") for cut in ("", "_cut")]
    assert runs == [1, 1]
    assert s.planner.plan().steps == 1  # the newcomer joins: one step


async def wait_until(condition: Callable[[], bool], turns: int = 1000) -> None:
    """Lets the event loop turn until `condition` holds (no clock: the loop only has in-process work)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")
