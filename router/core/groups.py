"""Several shard groups behind one router (`--replicas`, `--shard-groups`): one line, one set of keys and fair
shares, a scheduler per group, and the placement that sends each request to one of them.

Each group is a whole tensor-parallel deployment with its own KV pool, prefix cache and running batch, driven by its
own `Scheduler` loop; they share the waiting line (`GroupQueue` views of one `Queue`), so a priority or a key's
share holds across groups. A request is placed when it is submitted: every group is asked how much of its prompt it
has cached (nothing is held by asking) and how much work it has ahead, and the placement (`placement.py`) chooses.
A group that fails, or is drained, stops getting requests; those that waited on it go to the others at once, and
those it was running replay on the others (recomputed from their prompt and the tokens they streamed, as after any
failed step), while it restarts and rejoins. One group is the same code with nothing to choose.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from conveyor.router.core.adapter_registry import AdapterRegistry
from conveyor.router.core.block_allocator import PoolStats
from conveyor.router.core.placement import GroupView, NoGroup, Placed, Placement
from conveyor.router.core.queue import Queue
from conveyor.router.core.scheduler import Scheduler
from conveyor.router.core.sequence import Sequence
from conveyor.router.metrics import Metrics
from conveyor.router.transport.shard_client import ShardedClient

log = logging.getLogger(__name__)


class Unhealthy(RuntimeError):
    """No group serves: every one is restarting or drained, or none answers."""


class LastGroup(RuntimeError):
    """Draining the only group that serves would leave no group for new requests."""


class Groups:
    def __init__(
        self, schedulers: list[Scheduler], queue: Queue, placement: Placement, adapters: AdapterRegistry | None = None
    ) -> None:
        self.schedulers, self.queue, self.placement = schedulers, queue, placement
        self.metrics: Metrics = schedulers[0].metrics
        self.adapters = adapters or schedulers[0].adapters  # one registry: every group serves the same adapters
        self.adapters.in_batch = lambda name: any(s.adapters_in_batch(name) for s in schedulers)
        self._request_ids = itertools.count()
        for index, scheduler in enumerate(schedulers):
            scheduler.adapters = self.adapters
            scheduler.on_lost = lambda index=index: self.move_waiting(index)
            scheduler.on_gauges = self._set_totals

    # --- placing ------------------------------------------------------------------------------------------

    def new_request_id(self) -> int:
        return next(self._request_ids)

    def view(self, index: int, sequence: Sequence) -> GroupView:
        scheduler = self.schedulers[index]
        cached = scheduler.allocator.cached_prefix(sequence.cache_tokens, sequence.cache_scope)
        return GroupView(index, cached, load(scheduler), serving=scheduler.serving)

    def choose(self, sequence: Sequence) -> Placed:
        return self.placement.choose([self.view(i, sequence) for i in range(len(self.schedulers))])

    def submit(self, sequence: Sequence) -> None:
        try:
            placed = self.choose(sequence)
        except NoGroup:  # every group restarts: it waits for the first one back (the others are re-placed then)
            placed = Placed(min(range(len(self.schedulers)), key=lambda i: load(self.schedulers[i])), "load")
        self._count(sequence, placed)
        self.schedulers[placed.group].submit(sequence)

    def _count(self, sequence: Sequence, placed: Placed) -> None:
        self.metrics.placements.labels(str(placed.group), placed.reason).inc()
        if len(self.schedulers) > 1:
            log.info("placed", extra={"request": sequence.id, "group": placed.group, "reason": placed.reason})

    def move_waiting(self, index: int) -> None:
        """The group stopped serving (it failed, or is drained): what waits on it goes where the placement sends it
        among those that serve. A failed group's running sequences were put back in the line first, so they replay
        wherever they land; a drained group's running ones stay and finish there."""
        for sequence in self.schedulers[index].queue.sequences():
            try:
                placed = self.choose(sequence)
            except NoGroup:
                return  # nowhere else: they wait for this group to come back
            sequence.group = placed.group
            self._count(sequence, Placed(placed.group, "moved"))
            self.schedulers[placed.group].wake()
        self._update_gauges()

    # --- draining -----------------------------------------------------------------------------------------

    def drain(self, index: int) -> None:
        """Takes the group out of placement, for a deploy: its waiting requests go elsewhere, its running ones
        finish where they are. Refused (LastGroup) for the only group that serves."""
        if not any(s.serving for i, s in enumerate(self.schedulers) if i != index):
            raise LastGroup(f"group {index} is the only shard group serving: draining it would stop the server")
        self.schedulers[index].draining = True
        self.move_waiting(index)
        log.warning("group draining", extra={"group": index, "running": len(self.schedulers[index].running)})

    def resume(self, index: int) -> None:
        self.schedulers[index].draining = False
        self._update_gauges()
        log.warning("group serving again", extra={"group": index})

    # --- the whole --------------------------------------------------------------------------------------------

    @property
    def recovering(self) -> bool:
        """Whether no group serves (one group recovering leaves the others serving)."""
        return all(s.recovering for s in self.schedulers)

    @property
    def running(self) -> list[Sequence]:
        return [s for scheduler in self.schedulers for s in scheduler.running]

    @property
    def clients(self) -> list[ShardedClient]:
        return [s.client for s in self.schedulers]

    async def health(self, timeout: float) -> None:
        """Healthy while some group serves and answers; raises Unhealthy with the reason otherwise."""
        serving = [s for s in self.schedulers if s.serving]
        if not serving:
            raise Unhealthy("the shards are being restarted" if self.recovering else "every shard group is drained")
        answers = await asyncio.gather(*(s.client.health(timeout=timeout) for s in serving), return_exceptions=True)
        if all(isinstance(a, BaseException) for a in answers):
            raise Unhealthy(str(answers[0]))

    def pool(self) -> PoolStats:
        """Every group's KV pool together."""
        stats = [s.allocator.stats for s in self.schedulers]
        return PoolStats(*(sum(getattr(s, name) for s in stats) for name in PoolStats.__dataclass_fields__))

    def describe(self) -> dict:
        """What /info shows: the batching policy, the pools together, and each group."""
        body = self.schedulers[0].describe()
        pool = self.pool()
        body.update(
            status="recovering" if self.recovering else "serving",
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=sum(s.allocator.free_blocks for s in self.schedulers),
            kv_blocks_cached=pool.cached,
            placement=self.placement.name,
            groups=[self.describe_group(i) for i in range(len(self.schedulers))],
        )
        return body

    def describe_group(self, index: int) -> dict:
        scheduler, registry, label = self.schedulers[index], self.metrics.registry, {"group": str(index)}
        placed = sum(
            sample.value
            for metric in self.metrics.placements.collect()
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels["group"] == str(index)
        )
        return {
            "index": index,
            "status": scheduler.status,
            "num_shard": len(scheduler.client.urls) if scheduler.client is not None else 0,
            "running": len(scheduler.running),
            "waiting": len(scheduler.queue),
            "kv_blocks_total": scheduler.allocator.num_blocks,
            "kv_blocks_free": scheduler.allocator.free_blocks,
            "prefix_cache_hit_tokens": int(
                registry.get_sample_value("conveyor_group_prefix_cache_hits_total", label) or 0
            ),
            "prefix_cache_query_tokens": int(
                registry.get_sample_value("conveyor_group_prefix_cache_queries_total", label) or 0
            ),
            "placed": int(placed),
        }

    def _update_gauges(self) -> None:
        """Every group's gauges at once, when requests moved between them or one left or rejoined placement (not
        at each group's next step: a drained group may have none to take)."""
        for scheduler in self.schedulers:
            scheduler.update_gauges()

    def _set_totals(self) -> None:
        metrics = self.metrics
        metrics.queue_size.set(len(self.queue))
        metrics.batch_size.set(len(self.running))
        metrics.kv_blocks_total.set(sum(s.allocator.num_blocks for s in self.schedulers))
        metrics.kv_blocks_used.set(sum(s.allocator.num_blocks - s.allocator.free_blocks for s in self.schedulers))
        metrics.tgi.current_max_tokens.set(
            sum((s.allocator.num_blocks - s.allocator.free_blocks) * s.allocator.block_size for s in self.schedulers)
        )

    async def run(self) -> None:
        """Every group's loop; the first to crash ends them all (the router then exits)."""
        tasks = [asyncio.create_task(s.run(), name=f"batching group {s.group}") for s in self.schedulers]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    def abort(self, message: str) -> None:
        for scheduler in self.schedulers:
            scheduler.abort(message)


def load(scheduler: Scheduler) -> int:
    """Tokens the group has ahead of it: what its running sequences may still generate, and the prompts and
    allowances of those placed on it and waiting."""
    running = sum(max(0, s.tokens_left) for s in scheduler.running)
    waiting = sum(s.num_prompt_tokens + s.max_new_tokens for s in scheduler.queue.sequences())
    return running + waiting
