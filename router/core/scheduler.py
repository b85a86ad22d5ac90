"""The batching loop: one task owns the shards' batch, and each step is planned, posted and applied here.

`StepPlanner` decides what a step computes (it owns the running set and the blocks); this loop turns the plan
into one RPC and applies its result. If sequences join at a step, the RPC is a `Prefill` carrying them with
the running batch as `cached_batch` (a mixed step: their prompt chunks go through the same forward as the
running decodes); otherwise a `Decode`. Either way it carries `updates`: the blocks each running sequence grows
into and the next chunk of each prompt still being read. A preemption is a `FilterBatch` before the step.
After every step each token goes to its sequence's stream at once, and sequences that finished, or whose client
went away, are filtered out of the shards' batch so that their blocks are free for the next step. A plan of
several steps (`StepPlan.steps`: all decoding, nobody waiting to join) is a `DecodeRun`, applied step by step.
What the RPC says of each sequence is in router/core/step_messages.py, how its result reaches the streams in
router/core/delivery.py, and who a failed step is blamed on in router/core/replay.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager

from conveyor import tracing
from conveyor.router.core.adapter_registry import AdapterRegistry
from conveyor.router.core.block_allocator import BlockAllocator
from conveyor.router.core.delivery import Delivery
from conveyor.router.core.queue import GroupQueue, Queue
from conveyor.router.core.replay import replay
from conveyor.router.core.sequence import Sequence
from conveyor.router.core.settle import Settle
from conveyor.router.core.step_messages import new_request, step_updates
from conveyor.router.core.step_planner import PlannerConfig, StepPlan, StepPlanner
from conveyor.router.metrics import Metrics
from conveyor.router.transport.connect import Connection
from conveyor.router.transport.records import Batch, CachedBatch, StepResult
from conveyor.router.transport.shard_client import Metadata, ShardedClient, ShardError

log = logging.getLogger(__name__)

RECONNECT_SECONDS = 0.2  # between two tries to reach restarted shards
IDLE_CHECK_SECONDS = 1.0  # how often an idle router makes sure its shards are the ones it warmed up

Reconnect = Callable[[], Awaitable[Connection]]


class Scheduler:
    def __init__(
        self,
        client: ShardedClient,
        config: PlannerConfig,
        allocator: BlockAllocator,
        metrics: Metrics,
        reconnect: Reconnect | None = None,
        max_request_retries: int = 2,
        adapters: AdapterRegistry | None = None,
        queue: GroupQueue | None = None,
    ) -> None:
        """`queue`: this group's view of the line several groups share (router/core/groups.py), whose index is
        the group's label in the metrics; a line of its own, group 0, when none is given."""
        self.client = client
        self.queue = queue if queue is not None else GroupQueue(Queue(), 0)
        self.group = self.queue.group
        self.adapters = adapters or AdapterRegistry()  # the LoRA adapters the shards hold
        self.adapters.in_batch = self.adapters_in_batch
        self.config = config
        self.allocator = allocator
        self.metrics = metrics
        self.reconnect = reconnect  # warmed-up shards again, after a failed step (None: nothing to recover)
        self.max_request_retries = max_request_retries
        self.settle = Settle()  # how long an idle server waits for a burst to finish arriving
        self.planner = StepPlanner(config, allocator, self.queue)
        self.delivery = Delivery(self.planner, metrics, self.group)  # each step's tokens to their streams
        self._show_step_costs()
        self.recovering = False  # the shards' batch was lost and the loop waits for the shards to come back
        self.draining = False  # nothing new is placed here; what runs and waits here finishes (router/core/groups.py)
        # Set by Groups (router/core/groups.py), which every scheduler serves in, one group or several: after a
        # failure, its waiting sequences go to other groups; after any change, the label-less totals over all groups.
        self.on_lost: Callable[[], None] = lambda: None
        self.on_gauges: Callable[[], None] = lambda: None
        self.batch: CachedBatch | None = None  # the running batch on the shards
        self._wakeup = asyncio.Event()
        self._batch_ids = itertools.count()

    def _show_step_costs(self) -> None:
        costs = self.config.step_costs
        for rows in costs.rows if self.planner.drafts is not None else ():
            self.metrics.speculative_step_cost.labels(str(self.group), str(rows)).set(costs.ratio(rows))

    @property
    def running(self) -> list[Sequence]:
        """Every sequence in the shards' batch, in admission order (the planner's list: there is no other)."""
        return self.planner.running

    def adapters_in_batch(self, name: str) -> bool:
        """Whether the shards' batch still holds a request of the adapter (one whose caller left stays there until
        the next step filters it out)."""
        return any(s.request.parameters.adapter == name for s in self.running)

    def submit(self, sequence: Sequence) -> None:
        self.queue.append(sequence)
        self.update_gauges()
        self.wake()

    def wake(self) -> None:
        """Something was placed on this group: an idle loop plans a step."""
        self._wakeup.set()

    @property
    def serving(self) -> bool:
        """Whether new requests may be placed here."""
        return not self.recovering and not self.draining

    def describe(self) -> dict:
        """What /info shows of the batching policy, and the KV pool's use, live (free counts evictable cached
        blocks)."""
        allocator = self.allocator
        return {
            "status": self.status,
            "scheduling": self.config.scheduling,
            "prefix_caching": allocator.prefix_caching,
            "chunked_prefill": True,
            "prefill_chunk_tokens": self.config.prefill_chunk_tokens,
            "max_decode_steps": self.config.max_decode_steps,
            "speculate": self.config.speculate,
            "speculate_max_batch": self.config.speculate_max_batch,
            "block_size": allocator.block_size,
            "kv_blocks_total": allocator.num_blocks,
            "kv_blocks_free": allocator.free_blocks,
            "kv_blocks_cached": allocator.cached_blocks,
        }

    @property
    def status(self) -> str:
        return "recovering" if self.recovering else "draining" if self.draining else "serving"

    async def run(self) -> None:
        """Runs for ever: plan a step, drop what it preempted, post it, apply its result."""
        while True:
            if not self.running:
                await self.settle.wait(lambda: len(self.queue))
            plan = self.planner.plan()
            if plan.preempted and not await self.drop_preempted(plan.preempted):
                continue  # the shards were lost meanwhile: recovery put the plan's sequences back in the queue
            if plan.empty:
                await self._idle()
                continue
            await self.step(plan)
            self.update_gauges()

    async def _idle(self) -> None:
        """Nothing to compute: wait for a request, or for a static batch's timeout. Every IDLE_CHECK_SECONDS of
        that the shards are looked at, so that a group restarted meanwhile is found, reconnected and warmed up
        before a request pays for it with a failed step and a replay."""
        self.update_gauges()
        deadline = self.planner.next_deadline()
        until_deadline = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(self._wakeup.wait(), min(until_deadline, IDLE_CHECK_SECONDS))
        except asyncio.TimeoutError:
            if until_deadline > IDLE_CHECK_SECONDS:  # the check's turn, not the static batch's
                await self.check_shards()
            return
        self._wakeup.clear()

    async def check_shards(self) -> None:
        """Reconnects if the shards do not answer, or answer as other processes than the ones warmed up. A request
        that arrives meanwhile cuts the check short: it is served at once rather than after a slow shard's Info
        (and a shard that is really gone fails its step, which recovers the same way)."""
        if self.reconnect is None:
            return
        check = asyncio.ensure_future(self.client.infos(timeout=self.client.step_timeout))
        arrival = asyncio.ensure_future(self._wakeup.wait())
        await asyncio.wait([check, arrival], return_when=asyncio.FIRST_COMPLETED)
        arrival.cancel()
        if not check.done():
            check.cancel()
            return
        try:
            infos = check.result()
            if [info.instance for info in infos] == self.client.instances:
                return
            error = ShardError("the shards were restarted while the router was idle")
        except ShardError as exc:
            error = exc
        await self._recover(error)

    # --- one step -----------------------------------------------------------------------------------------

    async def step(self, plan: StepPlan) -> None:
        """Posts the plan as one RPC (a decode run when it plans several steps) and applies its result: tokens
        streamed, sequences that finished or were cancelled let go. A failed step recovers before it returns."""
        if plan.steps > 1:
            await self._decode_run(plan)
            return
        self._join(plan.admitted)
        self._count(plan)
        method = "prefill" if plan.admitted else "decode"
        in_batch = list(self.running)
        joins_running = bool(plan.admitted) and self.batch is not None
        with self._step_span(method, in_batch) as metadata:
            try:
                started = time.perf_counter()
                with self.metrics.step.labels(method).time():
                    result = await self._post(plan, metadata)
            except ShardError as exc:
                await self._recover(exc)
                return
        tgi = self.metrics.tgi
        tgi.step(method, len(plan.admitted), joins_running, time.perf_counter() - started)
        self.delivery.observe(result, method)
        sent = time.perf_counter()
        self.delivery.deliver(result)
        tgi.decode.labels(method).observe(time.perf_counter() - sent)
        self.planner.advance(plan, {g.request_id: len(g.tokens.ids) for g in result.generations})
        if result.batch is None:  # every sequence of the batch finished
            self.batch = None
            self._forget(in_batch)
            return
        try:
            kept = time.perf_counter()
            self.batch = await self._keep(result.batch, [s for s in in_batch if self._alive(s)])
            tgi.filter.labels(method).observe(time.perf_counter() - kept)
        except ShardError as exc:
            await self._recover(exc)

    async def _decode_run(self, plan: StepPlan) -> None:
        """A decode run: up to `plan.steps` steps in one call, each applied as it comes (its tokens streamed at
        once, finished sequences let go); an arrival that could join, or a client gone, ends it after the step in
        progress, and the loop's next step is planned as usual."""
        with self._step_span("decode_run", list(self.running)) as metadata:
            try:
                run = await self.client.decode_run([self.batch], plan.steps, metadata, step_updates(plan))
                self.metrics.decode_runs.inc()
                try:
                    last = time.perf_counter()
                    while (result := await run.next()) is not None:
                        now = time.perf_counter()
                        self.metrics.step.labels("decode").observe(now - last)
                        last = now
                        self._apply_run_step(result)
                        if not run.stopping and self._cut_run():
                            self.metrics.decode_runs_cut.inc()
                            await run.stop()
                finally:
                    run.close()
                if self.batch is not None:
                    self.batch = await self._keep(self.batch, [s for s in self.running if self._alive(s)])
            except ShardError as exc:
                await self._recover(exc)

    def _cut_run(self) -> bool:
        return self.planner.waiting_to_join() or any(s.cancelled for s in self.running)

    def _apply_run_step(self, result: StepResult) -> None:
        """One step of a run: every sequence that got a token computed one more; those the shards dropped from
        the batch (finished) leave the running set."""
        self.delivery.observe(result)
        stepped = {g.request_id for g in result.generations}
        for sequence in self.running:
            if sequence.id in stepped:
                self.planner.advance_sequence(sequence, 1)
        self.delivery.deliver(result)
        live = set(result.batch.request_ids) if result.batch is not None else set()
        self._forget([s for s in self.running if s.id not in live])
        self.batch = result.batch

    async def _post(self, plan: StepPlan, metadata: Metadata) -> StepResult:
        updates = step_updates(plan)
        if not plan.admitted:
            return await self.client.decode([self.batch], metadata, updates)
        batch = Batch(id=next(self._batch_ids), requests=[new_request(s) for s in plan.admitted])
        return await self.client.prefill(batch, metadata, self.batch, updates)

    def _join(self, sequences: Iterable[Sequence]) -> None:
        """Their wait in the queue ends the first time they join (not when a preempted one comes back)."""
        now = time.monotonic()
        for sequence in sequences:
            if sequence.batched_at is None:
                sequence.batched_at = now
                sequence.queue_span.end()
                self.metrics.queue_time.observe(now - sequence.queued_at)
                self.metrics.prompt_tokens.inc(sequence.num_prompt_tokens)

    def _count(self, plan: StepPlan) -> None:
        self.metrics.prefix_cache_queries.inc(plan.cache_queries)
        self.metrics.prefix_cache_hits.inc(plan.cache_hits)
        self.metrics.group_prefix_cache_queries.labels(str(self.group)).inc(plan.cache_queries)
        self.metrics.group_prefix_cache_hits.labels(str(self.group)).inc(plan.cache_hits)
        chunks = [s for s in plan.sequences if s.num_computed_tokens + s.step_tokens < s.num_prefill_tokens]
        self.metrics.prefill_chunks.inc(len(chunks))
        self.metrics.speculative_offered.inc(sum(s.step_drafts for s in plan.running))

    @contextmanager
    def _step_span(self, method: str, sequences: list[Sequence]) -> Iterator[Metadata]:
        """A span for one step, in the trace of its first request and linked to every other one; yields the
        gRPC metadata that carries it to the shards."""
        spans = [s.span for s in sequences if s.span]
        with tracing.span(method, spans[0] if spans else None, links=spans[1:], batch_size=len(spans)) as span:
            yield tracing.inject(span)

    # --- leaving the batch --------------------------------------------------------------------------------

    @staticmethod
    def _alive(sequence: Sequence) -> bool:
        return not sequence.is_finished and not sequence.cancelled

    async def _keep(self, batch: CachedBatch, keep: list[Sequence]) -> CachedBatch | None:
        """Keeps on the shards only `keep`; the rest of the batch's sequences leave the running set."""
        kept, in_batch = {s.id for s in keep}, set(batch.request_ids)
        self._forget([s for s in self.running if s.id not in kept and s.id in in_batch])
        if len(kept) == len(batch.request_ids):
            return batch
        if not kept:
            await self.client.clear_cache(batch.id)
            return None
        return await self.client.filter_batch(batch.id, [r for r in batch.request_ids if r in kept])

    def _forget(self, sequences: Iterable[Sequence]) -> None:
        for sequence in list(sequences):
            self.planner.remove(sequence)

    async def drop_preempted(self, preempted: list[Sequence]) -> bool:
        """The planner took the preempted sequences' blocks: the shards must forget them before the next step.
        False when the shards failed meanwhile: the step just planned is void (it would decode a batch that no
        longer exists), and its sequences are back in the queue."""
        self.metrics.preemptions.inc(len(preempted))
        log.info("preempted", extra={"requests": [s.id for s in preempted]})
        if self.batch is None:
            return True
        try:  # the planner already took them out of the running set: keep what is left
            self.batch = await self._keep(self.batch, list(self.running))
        except ShardError as exc:
            await self._recover(exc)
            return False
        return True

    # --- failure and recovery -----------------------------------------------------------------------------

    async def _recover(self, error: ShardError) -> None:
        """A step failed (a rank died, hung or raised), or an idle check found the shards gone or restarted, so
        the shards' batch is lost. Every running sequence goes back to the queue to be recomputed from its prompt
        and the tokens it has streamed, as after a preemption: its stream goes on after a pause with no gap and
        no duplicate. The loop then waits until the shards answer again (the launcher restarts a group that lost
        a rank; a hung group is killed here first), warms them up, and resumes with an empty KV pool."""
        log.error("shards lost; recovering", extra={"error": str(error)})
        self.recovering, self.batch = True, None
        # A group across nodes restarts whatever the failure: a node lost whole (its launcher with its ranks) moves
        # no epoch itself, and the ranks that survived may sit idle in a group that can never run again.
        if error.timed_out or self.client.restart_group is not None:
            self.client.kill()
        self.metrics.requests_replayed.inc(replay(self.planner, self.max_request_retries, str(error)))
        self.on_lost()
        self.update_gauges()
        await self._reconnect()
        self.recovering = False

    async def _reconnect(self) -> None:
        """Tries until restarted shards answer and are warmed up; their KV died with them, so the pool starts
        empty (prefix cache included), sized by the new warmup."""
        if self.reconnect is None:
            raise RuntimeError("a step failed and this scheduler cannot reconnect to shards")
        await self.client.close()
        while True:
            try:
                connection = await self.reconnect()
                break
            except Exception as exc:  # noqa: BLE001 - shards still down or starting: try again
                log.info("shards not ready yet", extra={"error": str(exc)})
                await asyncio.sleep(RECONNECT_SECONDS)
        self.client = connection.client
        self.adapters.learn(connection.info)
        await self.adapters.restore(self.client)  # the live ones, before any request naming one is replayed
        self.allocator.reset(connection.num_blocks)
        self.metrics.shard_restarts.inc()
        log.warning("shards recovered", extra={"queued": len(self.queue), "kv_blocks": connection.num_blocks})

    def abort(self, message: str) -> None:
        """Ends every request, running or queued, with an `unavailable` error event: the server is stopping and
        they could not finish. Only once the loop is stopped (it would step the sequences otherwise)."""
        for sequence in [*self.running, *self.queue.take_all()]:
            self.planner.remove(sequence)
            if not sequence.is_finished:
                sequence.fail(message, "unavailable")
        self.update_gauges()

    def update_gauges(self) -> None:
        """Its group-labelled gauges, then (through `on_gauges`) the totals over every group: after each step, and
        whenever Groups moves or drains what it holds."""
        group, metrics = str(self.group), self.metrics
        metrics.group_queue_size.labels(group).set(len(self.queue))
        metrics.group_batch_size.labels(group).set(len(self.running))
        metrics.group_kv_blocks_total.labels(group).set(self.allocator.num_blocks)
        metrics.group_kv_blocks_used.labels(group).set(self.allocator.num_blocks - self.allocator.free_blocks)
        metrics.group_serving.labels(group).set(int(self.serving))
        self.on_gauges()
