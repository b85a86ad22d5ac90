"""One request at a time: the next joins when the running one has finished (a baseline to measure batching by)."""

from __future__ import annotations

from conveyor.router.core.policies.base import SchedulingPolicy
from conveyor.router.core.queue import Queue


class Sequential(SchedulingPolicy):
    def batch_limit(self, running: int, queue: Queue) -> int:
        return 0 if running else 1
