"""Static batching: wait for a full batch (or the oldest request's timeout), run it to completion, and admit nobody
meanwhile; the batch reads all its prompts at its first step, as a padded batch would."""

from __future__ import annotations

import time

from conveyor.router.core.policies.base import SchedulingPolicy
from conveyor.router.core.queue import Queue

DEFAULT_STATIC_BATCH_SIZE = 32


class Static(SchedulingPolicy):
    def batch_limit(self, running: int, queue: Queue) -> int:
        if running:
            return 0
        size = self.max_batch_size or DEFAULT_STATIC_BATCH_SIZE
        deadline = self.deadline(running, queue)
        full = len(queue) >= size
        return size if full or (deadline is not None and time.monotonic() >= deadline) else 0

    def newcomer_budget(self, budget: int) -> int:
        return 1 << 30  # the per-step prompt budget does not split a batch

    def deadline(self, running: int, queue: Queue) -> float | None:
        if running or (first := queue.peek()) is None:
            return None
        return first.queued_at + self.batch_timeout
