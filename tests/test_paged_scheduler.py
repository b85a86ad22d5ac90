"""The paged scheduler's own waiting rule, without processes: a burst at an idle server is queued whole first."""

from __future__ import annotations

import asyncio

from conveyor.router.block_allocator import BlockAllocator
from conveyor.router.metrics import Metrics
from conveyor.router.paged_scheduler import SETTLE_QUIET_TURNS, PagedScheduler
from conveyor.router.step_planner import PlannerConfig
from test_policy import entry


def scheduler() -> PagedScheduler:
    return PagedScheduler(None, PlannerConfig(max_batch_prefill_tokens=1000), Metrics(), BlockAllocator(64, 16))


async def test_an_idle_server_waits_for_a_burst_that_is_still_arriving() -> None:
    s = scheduler()

    async def arrive(n: int) -> None:
        for _ in range(n):  # a handler that parses and validates for a few turns, then queues
            await asyncio.sleep(0)
        s.submit(entry(n, 8))

    arrivals = [asyncio.create_task(arrive(n)) for n in range(SETTLE_QUIET_TURNS * 3)]
    await s._settle()
    assert len(s.queue) == len(arrivals)
    plan = s.planner.plan()
    assert len(plan.admitted) == len(arrivals)  # one first step for the whole burst
    await asyncio.gather(*arrivals)


async def test_a_lone_request_waits_only_a_few_turns() -> None:
    s = scheduler()
    s.submit(entry(0, 8))
    turns = 0

    async def count() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count())
    await s._settle()
    counter.cancel()
    assert turns <= SETTLE_QUIET_TURNS + 1
