"""The paged engine's batching loop: one step at a time, each planned by `StepPlanner`.

A step is one RPC. If requests join at it, it is a `Prefill` carrying them with the running batch as
`cached_batch` (a mixed step: their prompt chunks go through the same forward as the running decodes);
otherwise a `Decode`. Either way it carries `updates`: the blocks each running request grows into and the
next chunk of each prompt still being read. A preemption is a `FilterBatch` before the step.
"""

from __future__ import annotations

import asyncio
import logging
import time

from conveyor.router.shard_client import ShardedClient, ShardError, StepResult
from conveyor.router.block_allocator import BlockAllocator
from conveyor.router.metrics import Metrics
from conveyor.router.queue import Entry
from conveyor.router.scheduler import Scheduler, request_pb
from conveyor.router.step_planner import PlannerConfig, StepPlan, StepPlanner, Work
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

SETTLE_QUIET_SECONDS = 0.01  # a burst has finished arriving when nobody new came for this long
SETTLE_SECONDS = 0.1  # the longest an idle server waits for a burst to finish arriving


class PagedScheduler(Scheduler):
    def __init__(
        self, client: ShardedClient, config: PlannerConfig, metrics: Metrics, allocator: BlockAllocator
    ) -> None:
        super().__init__(client, metrics)
        self.config = config
        self._allocator = allocator
        self.planner = StepPlanner(config, allocator, self.queue)
        self._batch: pb.CachedBatch | None = None  # the running batch on the shards
        self._plan: StepPlan | None = None

    @property
    def allocator(self) -> BlockAllocator:
        return self._allocator

    def describe(self) -> dict:
        return {
            "scheduling": self.config.scheduling.value,
            "prefix_caching": self._allocator.prefix_caching,
            "chunked_prefill": True,
            "prefill_chunk_tokens": self.config.prefill_chunk_tokens,
        }

    async def run(self) -> None:
        while True:
            if not self.planner.running:
                await self._settle()
            plan = self.planner.plan()
            if plan.preempted:
                await self._drop_preempted(plan.preempted)
            if plan.empty:
                await self._idle()
                continue
            await self._run(plan)

    async def _settle(self) -> None:
        """Requests that arrive together at an idle server join its first step together: the step waits until
        nobody new has been queued for SETTLE_QUIET_SECONDS (at most SETTLE_SECONDS in all). Otherwise the first
        arrivals start decoding at once and the rest of a burst is read in small chunks behind them, waiting
        seconds for a first token. Counting event-loop turns instead was not enough: a client sending 32
        requests takes several milliseconds to get them all through HTTP parsing and validation, and on a
        2-core machine the first step then took 1 or 2 of them (measured: first tokens spread over 6 s)."""
        start = last_arrival = time.monotonic()
        queued = len(self.queue)
        while (now := time.monotonic()) - last_arrival < SETTLE_QUIET_SECONDS and now - start < SETTLE_SECONDS:
            await asyncio.sleep(SETTLE_QUIET_SECONDS / 10)
            if len(self.queue) != queued:
                queued, last_arrival = len(self.queue), time.monotonic()

    async def _idle(self) -> None:
        """Nothing to compute: wait for a request, or for a static batch's timeout."""
        self._update_gauges()
        deadline = self.planner.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wakeup.clear()

    async def _run(self, plan: StepPlan) -> None:
        self._join(w.entry for w in plan.admitted)
        self._count(plan)
        updates = [_update(w) for w in plan.running if w.new_blocks or w.entry.prefilling]
        batches = [self._batch] if self._batch is not None else []
        self._plan = plan
        if plan.admitted:
            batch = pb.Batch(id=next(self._batch_ids), requests=[_request(w) for w in plan.admitted],
                             size=len(plan.admitted))  # fmt: skip
            ids = [w.entry.id for w in plan.admitted]
            batches.append(pb.CachedBatch(id=batch.id, request_ids=ids, size=len(ids)))
            with self._step_span("prefill", batches) as metadata:
                call = self.client.prefill(batch, metadata, self._batch, updates)
                self._batch = await self._step(batches, call, "prefill")
        else:
            with self._step_span("decode", batches) as metadata:
                self._batch = await self._step(batches, self.client.decode(batches, metadata, updates), "decode")
        self._plan = None

    def _count(self, plan: StepPlan) -> None:
        self.metrics.prefix_cache_queries.inc(plan.cache_queries)
        self.metrics.prefix_cache_hits.inc(plan.cache_hits)
        chunks = [w for w in (*plan.running, *plan.admitted) if w.entry.computed + w.tokens < w.entry.target]
        self.metrics.prefill_chunks.inc(len(chunks))

    def _stepped(self, result: StepResult) -> None:
        if self._plan is not None:
            self.planner.advance(self._plan)

    def _release(self, entry: Entry) -> None:
        self.planner.remove(entry)

    async def _drop_preempted(self, preempted: list[Entry]) -> None:
        """The planner took the preempted requests' blocks: the shards must forget them before the next step."""
        self.metrics.preemptions.inc(len(preempted))
        log.info("preempted", extra={"requests": [e.id for e in preempted]})
        for entry in preempted:
            self.running.pop(entry.id, None)
        if self._batch is None:
            return
        gone = {e.id for e in preempted}
        keep = [r for r in self._batch.request_ids if r not in gone]
        try:
            self._batch = await self._keep(self._batch, keep)
        except ShardError as exc:
            batch, self._batch = self._batch, None
            await self._fail([batch], str(exc))

    async def _fail(self, batches: list[pb.CachedBatch], message: str) -> None:
        await super()._fail(batches, message)
        self._batch = None


def _request(work: Work) -> pb.Request:
    request = request_pb(work.entry)
    request.cache_len = work.cache_len
    request.chunk_len = work.tokens
    return request


def _update(work: Work) -> pb.RequestUpdate:
    chunk = work.tokens if work.entry.prefilling else 0
    return pb.RequestUpdate(request_id=work.entry.id, new_blocks=work.new_blocks, chunk_len=chunk)
