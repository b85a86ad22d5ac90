"""Continuous batching: requests join and leave at every step, up to --max-batch-size running at once."""

from __future__ import annotations

from conveyor.router.core.policies.base import SchedulingPolicy
from conveyor.router.core.queue import Queue


class Continuous(SchedulingPolicy):
    def batch_limit(self, running: int, queue: Queue) -> int:
        return self.max_batch_size or 1 << 30
