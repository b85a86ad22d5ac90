"""When a burst of requests at an idle server has finished arriving, so that its first step takes all of it.

The clock and the sleep are the caller's to give: the rule is about time, and its tests run it on a fake clock
instead of hoping that the event loop's timers fire on time on a loaded machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

SETTLE_QUIET_SECONDS = 0.01  # a burst has finished arriving when nobody new came for this long
SETTLE_SECONDS = 0.1  # the longest an idle server waits for a burst to finish arriving
LOOKS_PER_GAP = 10  # how often the queue is looked at within one quiet gap


@dataclass
class Settle:
    """Requests that arrive together at an idle server join its first step together: `wait` returns once
    nobody new has been queued for `quiet` seconds, and after `limit` seconds in all. Otherwise the first
    arrivals start decoding at once and the rest of a burst is read in small chunks behind them, waiting
    seconds for a first token. Counting event-loop turns instead was not enough: a client sending 32
    requests takes many turns to get them all through HTTP parsing and validation, and on a 2-core machine
    the first step then took only the first few of them, spreading the burst's first tokens over seconds
    (`python -m benchmarks.serve --request-rate inf`, benchmarks/serve.py, shows it in the TTFT spread)."""

    quiet: float = SETTLE_QUIET_SECONDS
    limit: float = SETTLE_SECONDS
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def wait(self, queued: Callable[[], int]) -> None:
        """`queued` counts the requests waiting; a change in the count is an arrival."""
        start = last_arrival = self.clock()
        count = queued()
        while (now := self.clock()) - last_arrival < self.quiet and now - start < self.limit:
            await self.sleep(self.quiet / LOOKS_PER_GAP)
            if queued() != count:
                count, last_arrival = queued(), self.clock()
