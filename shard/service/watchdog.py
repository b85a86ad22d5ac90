"""A shard that tells the truth about a stuck forward: its health turns NOT_SERVING once a step has run past the
step deadline, so that whatever supervises it (Kubernetes, a compose health check, the router) can restart it.

The event loop keeps answering while the forward runs on its worker thread, so answering alone proves nothing.
The clock is the caller's to give: the tests move a fake one instead of waiting out a deadline.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# With no --shard-step-timeout, a step may take this many times the warmup (the largest prefill there is), and
# never less than MIN_STEP_TIMEOUT seconds: generous, since a loaded machine stretches every step.
STEP_TIMEOUT_WARMUPS = 10
MIN_STEP_TIMEOUT = 60.0
WATCH_SECONDS = 1.0  # how often the health status is brought up to date


def step_timeout(requested: float, warmup_seconds: float) -> float:
    """The step deadline: the one the router asked for, else one derived from the warmup's time."""
    return requested if requested > 0 else max(MIN_STEP_TIMEOUT, STEP_TIMEOUT_WARMUPS * warmup_seconds)


@dataclass
class StepWatch:
    """The steps in flight and when each started; `timeout` is None until the warmup has chosen it."""

    timeout: float | None = None
    clock: Callable[[], float] = time.monotonic
    _started: dict[int, float] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    @contextmanager
    def step(self) -> Iterator[None]:
        key = next(self._ids)
        self._started[key] = self.clock()
        try:
            yield
        finally:
            del self._started[key]

    def running_for(self) -> float:
        """Seconds the oldest step in flight has run (0 when none runs)."""
        return self.clock() - min(self._started.values()) if self._started else 0.0

    def stuck(self) -> str | None:
        """Why the shard must not count as healthy, if it must not."""
        running = self.running_for()
        if self.timeout is None or running <= self.timeout:
            return None
        return f"a step has run for {running:.0f} s, past the step timeout of {self.timeout:g} s"
