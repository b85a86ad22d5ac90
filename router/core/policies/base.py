"""The questions the step planner asks a scheduling policy: when waiting requests may join the running batch, and
how much of a step's prompt budget they may read. Blocks, preemption, chunking and drafts stay the planner's, the
same under every policy, so a policy is only these answers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from conveyor.router.core.queue import Queue


class SchedulingPolicy(ABC):
    """One `--scheduling` value. Built once with the deployment's batch limits; the planner then asks it at every
    step, with the running set's size and the queue as they are."""

    def __init__(self, max_batch_size: int | None = None, batch_timeout: float = 1.0) -> None:
        self.max_batch_size = max_batch_size  # --max-batch-size (None: the policy's own default)
        self.batch_timeout = batch_timeout  # --static-batch-timeout: seconds a batch may wait to fill up

    @abstractmethod
    def batch_limit(self, running: int, queue: Queue) -> int:
        """How many sequences may be running once this step's newcomers joined, `running` being in the batch now:
        `running` or fewer admits nobody. The planner also asks it between the steps of a decode run, which a
        waiting request that could join cuts short."""

    def newcomer_budget(self, budget: int) -> int:
        """The prompt tokens this step's newcomers may read, of the `budget` the running sequences left."""
        return budget

    def deadline(self, running: int, queue: Queue) -> float | None:
        """When the policy stops waiting for more requests (monotonic seconds), if it waits: an idle loop plans
        again then, though nothing arrived."""
        return None
