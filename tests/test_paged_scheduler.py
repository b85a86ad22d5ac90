"""The paged scheduler's own waiting rule, without processes: a burst at an idle server is queued whole first."""

from __future__ import annotations

import asyncio

from conveyor.router.block_allocator import BlockAllocator
from conveyor.router.metrics import Metrics
from conveyor.router.paged_scheduler import SETTLE_QUIET_SECONDS, PagedScheduler
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

    arrivals = [asyncio.create_task(arrive(n)) for n in range(10)]
    await s._settle()
    assert len(s.queue) == len(arrivals)
    plan = s.planner.plan()
    assert len(plan.admitted) == len(arrivals)  # one first step for the whole burst
    await asyncio.gather(*arrivals)


async def test_arrivals_closer_than_the_quiet_gap_are_one_burst() -> None:
    """Each arrival is due before the gap since the previous one has passed: when the loop runs late, the
    arrival's timer (due first) still runs before the settle loop's next look."""
    s = scheduler()
    s.submit(entry(0, 8))

    async def arrive(n: int) -> None:
        await asyncio.sleep(n * SETTLE_QUIET_SECONDS / 4)
        s.submit(entry(n, 8))

    arrivals = [asyncio.create_task(arrive(n)) for n in range(1, 6)]
    await s._settle()
    assert len(s.queue) == 6
    await asyncio.gather(*arrivals)


async def test_a_trickle_that_never_stops_does_not_hold_the_first_step_forever() -> None:
    s = scheduler()
    stop = asyncio.Event()

    async def trickle() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            s.submit(entry(n, 8))
            await asyncio.sleep(SETTLE_QUIET_SECONDS / 5)

    feeder = asyncio.create_task(trickle())
    await s._settle()  # returns (bounded by SETTLE_SECONDS) although requests keep coming
    stop.set()
    await feeder
    assert len(s.queue) > 1
